"""Bounds on what the service holds and takes on (issue 14 item 5): idle conversations in memory, turns at
once. History is the source of truth, so an idle conversation can always leave memory and come back."""

import asyncio

from statekeeper.sessions import TurnRequest


async def _turn(service, session, content, max_tokens=5):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


def test_idle_conversations_beyond_the_limit_leave_memory_and_come_back_whole(make_service):
    service = make_service(tiers=("dram",), max_idle_sessions=2)

    async def scenario():
        sessions = [(await service.create(None, None)).id for _ in range(5)]
        firsts = [await _turn(service, session, "Hello there, how are you?") for session in sessions]
        for session in sessions:
            await service.offload(session)
        await service.sweep()
        assert service.stats()["sessions_in_memory"] <= 2
        for session, first in zip(sessions, firsts):
            second = await _turn(service, session, "Tell me about Rome.")
            # The KV comes back from the tier (all but the last reply token, never fed), the history from
            # the store: nothing was lost.
            assert second.restore_source == "dram"
            assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1
            assert [m["content"] for m in await service.messages(session)] == [
                "Hello there, how are you?", first.content, "Tell me about Rome.", second.content]
        assert len({(await service.messages(session))[3]["content"] for session in sessions}) == 1
        await service.sweep()
        assert service.stats()["sessions_in_memory"] <= 2 + service.stats()["active_sessions"]

    asyncio.run(scenario())


def test_a_session_in_a_turn_or_holding_kv_is_never_dropped(make_service):
    service = make_service(tiers=("dram",), max_idle_sessions=0)

    async def scenario():
        active = (await service.create(None, None)).id
        first = await _turn(service, active, "Hello there, how are you?")
        await service.sweep()
        assert service.stats()["sessions_in_memory"] == 1  # it holds KV: not idle
        second = await _turn(service, active, "Tell me about Rome.")
        assert second.restore_source == "active"
        assert second.cached_tokens == first.prompt_tokens + first.completion_tokens - 1

    asyncio.run(scenario())
