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


def test_idle_conversations_are_bounded_by_bytes_not_only_by_count(make_service):
    """Conversations of 16 kB system prompts each, and room for about three of them: the count alone
    (10,000) would keep them all. The bound and what is held show in the stats."""
    service = make_service(tiers=("dram",), max_idle_bytes=64 * 1024)

    async def scenario():
        sessions = [(await service.create("s" * 16_000 + str(i), None)).id for i in range(12)]
        memory = service.stats()["memory"]["idle_sessions"]
        assert memory["max_bytes"] == 64 * 1024 and memory["bytes"] <= memory["max_bytes"]
        assert 1 <= service.stats()["sessions_in_memory"] <= 4
        for session in sessions:  # each comes back whole from the history
            assert (await service.view(session)).turns == 0

    asyncio.run(scenario())


def test_the_stored_blob_meta_remembered_is_bounded_by_bytes(make_service):
    service = make_service(tiers=("dram",), blob_meta_cache_bytes=1024)

    async def scenario():
        for _ in range(12):
            session = (await service.create(None, None)).id
            await _turn(service, session, "Hello there, how are you?", max_tokens=2)
            await service.offload(session)
            await service.view(session)  # reads and remembers the blob's meta
        remembered = service.stats()["memory"]["blob_meta"]
        assert remembered["max_bytes"] == 1024 and 0 < remembered["bytes"] <= 1024
        assert remembered["entries"] < 12

    asyncio.run(scenario())


def test_text_far_over_the_context_is_refused_before_it_is_tokenized(make_service):
    """Tokenizing and rendering run on the event loop that serves every request: text that cannot fit the
    context whatever its tokens (each token stands for at most the longest piece of the vocabulary) is
    refused before either, for a turn and for scoring."""
    from statekeeper.sessions import ContextOverflow

    service = make_service(tiers=("dram",))
    calls = []
    for name in ("extend", "append_turns"):
        method = getattr(service.formatter, name)
        setattr(service.formatter, name, lambda *args, _method=method, _name=name: calls.append(_name) or _method(*args))
    huge = "word " * 5000  # ~25,000 characters, some thousands of tokens; the tiny model's context is 1024

    async def scenario():
        session = (await service.create(None, None)).id
        for attempt in (lambda: _turn(service, session, huge),
                        lambda: service.score(session, [{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": huge}])):
            try:
                await attempt()
            except ContextOverflow:
                pass
            else:
                raise AssertionError("not refused")
        assert calls == []
        assert (await _turn(service, session, "Hello there")).prompt_tokens > 0  # a turn that fits still runs
        assert calls == ["extend"]

    asyncio.run(scenario())


def test_a_tenants_conversation_limit_holds_for_creates_at_once(make_service):
    """Counting a tenant's conversations and saving a new one are one step: three creates at once under a limit
    of one each counted none of the others before (three stored)."""
    from statekeeper.sessions.errors import TenantLimitReached
    from statekeeper.tenancy import TenantLimits

    service = make_service(tiers=("dram",), tenant_limits=TenantLimits(sessions=1))

    async def scenario():
        made = await asyncio.gather(*(service.create(None, None, tenant="acme") for _ in range(3)),
                                    return_exceptions=True)
        assert sum(isinstance(result, TenantLimitReached) for result in made) == 2
        assert service.history.count("acme") == 1

    asyncio.run(scenario())
