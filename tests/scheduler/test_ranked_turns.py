import asyncio

from scheduler.ranked_turns import RankedTurns


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


async def _task(turns: RankedTurns, name: str, ranks: list[float], order: list[str], gate: asyncio.Event):
    """A task that sends one job per rank, in turn, each job one pass of the loop (as a lane's job is awaited)."""
    for rank in ranks:
        async with turns.turn(rank):
            order.append(name)
            await gate.wait()
            await asyncio.sleep(0)


def test_the_lowest_rank_goes_first_and_equal_ranks_in_order_of_asking():
    async def scenario():
        turns, order, gate = RankedTurns(), [], asyncio.Event()
        tasks = [asyncio.ensure_future(_task(turns, "first", [50], order, gate))]
        await asyncio.sleep(0.01)
        assert order == ["first"]  # the turn was free: the first to ask holds it
        tasks += [asyncio.ensure_future(_task(turns, name, [rank], order, gate))
                  for name, rank in [("long", 900), ("short", 10), ("short-2", 10), ("mid", 200)]]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(*tasks)
        return order

    assert _run(scenario()) == ["first", "short", "short-2", "mid", "long"]


def test_a_task_with_less_left_keeps_the_turn_over_one_that_asked_before_its_next_job():
    """Shortest remaining work first, across jobs: a task that asks again as its job ends competes with those
    waiting, and the one with less left runs to its end before the other sends another job (served in order of
    asking, the two took turns job by job)."""
    async def scenario():
        turns, order, gate = RankedTurns(), [], asyncio.Event()
        gate.set()
        long = asyncio.ensure_future(_task(turns, "long", [6, 5, 4, 3, 2, 1], order, gate))
        await asyncio.sleep(0)
        short = asyncio.ensure_future(_task(turns, "short", [3, 2, 1], order, gate))
        await asyncio.gather(long, short)
        return order

    order = _run(scenario())
    assert order == ["long", "short", "short", "short", "long", "long", "long", "long", "long"]


def test_a_task_cancelled_while_it_waits_or_before_it_used_its_turn_passes_it_on():
    async def scenario():
        turns, order, gate = RankedTurns(), [], asyncio.Event()
        holder = asyncio.ensure_future(_task(turns, "holder", [1], order, gate))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(_task(turns, "cancelled-waiting", [0], order, gate))
        granted = asyncio.ensure_future(_task(turns, "cancelled-granted", [0.5], order, gate))
        last = asyncio.ensure_future(_task(turns, "last", [2], order, gate))
        await asyncio.sleep(0.01)
        waiting.cancel()
        gate.set()
        await holder
        granted.cancel()  # its turn has been handed to it, it has not resumed yet
        await asyncio.gather(last, waiting, granted, return_exceptions=True)
        return order

    assert _run(scenario()) == ["holder", "last"]
