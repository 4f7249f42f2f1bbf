"""The line next turns' preparations take a background lane in (sessions/preparation_order.py)."""

import asyncio
import time

from statekeeper.sessions.preparation_order import PreparationOrder


async def _preparation(order: PreparationOrder, name: str, jobs: int, ran: list[str], lane: int = 1,
                       at: float | None = None, first_job_ends: asyncio.Event | None = None) -> None:
    async with order.place(lane, at) as my_turn:
        for job in range(jobs):
            await my_turn()
            ran.append(name)
            if job == 0 and first_job_ends is not None:  # the job, on a model lane: others ask for places meanwhile
                await first_job_ends.wait()
            await asyncio.sleep(0)


def test_a_place_lower_in_the_line_takes_the_lane_at_the_next_job_and_the_rest_wait_for_it():
    async def scenario():
        order, ran, first_job_ends = PreparationOrder(), [], asyncio.Event()
        late = asyncio.ensure_future(_preparation(order, "late", 3, ran, at=time.monotonic(),
                                                  first_job_ends=first_job_ends))
        await asyncio.sleep(0)  # in its first job
        early = asyncio.ensure_future(_preparation(order, "early", 3, ran, at=time.monotonic() - 60))
        after = asyncio.ensure_future(_preparation(order, "after", 2, ran))  # by default: after those in line
        other_lane = asyncio.ensure_future(_preparation(order, "other lane", 1, ran, lane=0, at=time.monotonic()))
        await asyncio.sleep(0)  # they ask for their places
        first_job_ends.set()
        await asyncio.gather(late, early, after, other_lane)
        return ran

    ran = asyncio.run(scenario())
    assert [name for name in ran if name != "other lane"] == ["late", "early", "early", "early", "late", "late",
                                                              "after", "after"]
    assert "other lane" in ran[:3]  # a lane of its own: it waits for no one in the line of another


def test_a_preparation_cancelled_while_it_waits_leaves_the_line_and_the_next_one_goes_on():
    async def scenario():
        order, ran = PreparationOrder(), []
        gate = asyncio.Event()

        async def holds_the_lane():
            async with order.place(1, 0.0) as my_turn:
                await my_turn()
                await gate.wait()

        first = asyncio.ensure_future(holds_the_lane())
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(_preparation(order, "cancelled", 1, ran, at=1.0))
        last = asyncio.ensure_future(_preparation(order, "last", 1, ran, at=2.0))
        await asyncio.sleep(0)
        waiting.cancel()
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, last), 5)
        return ran, waiting.cancelled()

    assert asyncio.run(scenario()) == (["last"], True)
