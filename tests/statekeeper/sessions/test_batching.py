"""Turns of several conversations at once ride the same batched steps (scheduler/batch.py): each one's
reply is the one it gets alone, whoever joins or leaves the batch, and a turn cancelled mid-batch leaves
the others and its own history intact."""

import asyncio

import pytest

from statekeeper.sessions import TurnRequest

OPENERS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
           "Write a haiku about the sea.", "Why is the sky blue?"]


async def _turn(service, session, content, **options):
    async for event in service.turn(session, TurnRequest(content, **({"max_tokens": 16} | options))):
        pass
    return event


async def _sessions(service, count):
    return [(await service.create("be brief", None)).id for _ in range(count)]


async def _alone(service, contents, options):
    """Each opener on a fresh session, one turn at a time: the reference."""
    replies = []
    for content, option in zip(contents, options):
        (session,) = await _sessions(service, 1)
        replies.append((await _turn(service, session, content, **option)).content)
    return replies


def test_turns_at_once_ride_one_batch_and_get_the_replies_they_get_alone(make_service):
    service = make_service(tiers=("dram",))
    options = [{"max_tokens": 24}, {"max_tokens": 4}, {"max_tokens": 12}, {"max_tokens": 20}, {"max_tokens": 8}]

    async def scenario():
        expected = await _alone(service, OPENERS, options)
        before = service.stats()["model_thread"]
        sessions = await _sessions(service, len(OPENERS))

        async def late(session, content, option):  # joins a batch already under way
            await asyncio.sleep(0.05)
            return await _turn(service, session, content, **option)

        results = await asyncio.gather(*(_turn(service, s, c, **o) for s, c, o in zip(sessions[:3], OPENERS, options)),
                                       *(late(s, c, o) for s, c, o in zip(sessions[3:], OPENERS[3:], options[3:])))
        assert [r.content for r in results] == expected
        after = service.stats()["model_thread"]
        steps = after["batch_steps"] - before["batch_steps"]
        sessions_carried = after["batch_sessions"] - before["batch_sessions"]
        assert sessions_carried / steps > 1.5  # they did ride together
        assert steps < sum(o["max_tokens"] for o in options)

    asyncio.run(scenario())


def test_one_session_per_step_is_the_alone_mode(make_service):
    service = make_service(tiers=("dram",), batch_max_sessions=1)

    async def scenario():
        sessions = await _sessions(service, 3)
        await asyncio.gather(*(_turn(service, s, c) for s, c in zip(sessions, OPENERS)))
        stats = service.stats()["model_thread"]
        assert stats["batch_sessions"] == stats["batch_steps"] > 0

    asyncio.run(scenario())


def test_a_long_prefill_rides_in_chunks_beside_decoding_turns(make_service):
    service = make_service(tiers=("dram",), batch_prefill_tokens=64)  # the tiny worker's chunk: 64 tokens
    long_message = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)

    async def scenario():
        expected = await _alone(service, [OPENERS[0], long_message], [{"max_tokens": 40}, {"max_tokens": 4}])
        first, second = await _sessions(service, 2)
        decoding = asyncio.create_task(_turn(service, first, OPENERS[0], max_tokens=40))
        await asyncio.sleep(0.02)
        long_turn = await _turn(service, second, long_message, max_tokens=4)
        assert long_turn.prompt_tokens > 4 * 64
        assert [(await decoding).content, long_turn.content] == expected

    asyncio.run(scenario())


@pytest.mark.parametrize("after_tokens", [1, 5])
def test_a_turn_cancelled_mid_batch_leaves_the_others_and_its_own_history_intact(make_service, after_tokens):
    service = make_service(tiers=("dram",))

    async def scenario():
        expected = await _alone(service, OPENERS[:3], [{"max_tokens": 24}] * 3)
        sessions = await _sessions(service, 3)
        twin = (await _sessions(service, 1))[0]
        events = 0

        async def cancelled_turn():
            nonlocal events
            async for _ in service.turn(sessions[1], TurnRequest(OPENERS[1], max_tokens=24)):
                events += 1

        victim = asyncio.create_task(cancelled_turn())
        others = [asyncio.create_task(_turn(service, s, c, max_tokens=24)) for s, c in
                  ((sessions[0], OPENERS[0]), (sessions[2], OPENERS[2]))]
        while events < after_tokens:
            await asyncio.sleep(0.001)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert [(await task).content for task in others] == [expected[0], expected[2]]
        assert await service.messages(sessions[1]) == await service.messages(twin)  # not committed
        ours, theirs = [await _turn(service, s, OPENERS[3]) for s in (sessions[1], twin)]
        assert (ours.content, ours.prompt_tokens) == (theirs.content, theirs.prompt_tokens)

    asyncio.run(scenario())
