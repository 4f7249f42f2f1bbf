"""Clients that resend the whole conversation (statekeeper/sessions/resend.py, the OpenAI APIs): a conversation
the resend created is kept only once its first turn has ended in its result."""

import asyncio

import pytest

from statekeeper.sessions import TurnRequest
from statekeeper.sessions.turns import TurnResult
from statekeeper.tenancy import DEFAULT_TENANT

MESSAGES = [{"role": "user", "content": "Hello, how are you today?"}]


def test_a_new_conversation_whose_client_leaves_before_the_result_is_deleted_again(make_service):
    """Its client never learnt its id (the result carries it), nothing would find it again, and it would count
    against its tenant's conversations and stored bytes for good."""
    service = make_service(tiers=("dram",))

    async def scenario():
        _, first, events = await service.chat(MESSAGES, TurnRequest("", max_tokens=20))
        assert not isinstance(first, TurnResult)
        await events.aclose()  # the client goes away mid-stream
        assert service.history.count(DEFAULT_TENANT) == 0
        _, first, events = await service.chat(MESSAGES, TurnRequest("", max_tokens=3))
        async for _ in events:
            pass
        assert service.history.count(DEFAULT_TENANT) == 1

    asyncio.run(scenario())


def test_a_new_conversation_whose_branch_lookup_fails_is_never_made(make_service, monkeypatch):
    """The lookup of a conversation the messages branch from ran after the new conversation was made: where it
    failed (the history database down a moment) the request was a 503, and the conversation it had made, whose
    id no client ever learnt, counted against its tenant's conversations for good."""
    from statekeeper.history import HistoryUnavailable
    from statekeeper.sessions.errors import HistoryDown

    service = make_service(tiers=("dram",))

    def down(*args):
        raise HistoryUnavailable("the history database does not answer")

    monkeypatch.setattr(service.history, "find_branch", down)

    async def scenario():
        with pytest.raises(HistoryDown):
            await service.chat(MESSAGES, TurnRequest("", max_tokens=3))
        assert service.history.count(DEFAULT_TENANT) == 0

    asyncio.run(scenario())


def test_an_edited_later_turn_branches_with_no_idle_conversation_held(make_service):
    """MAX_IDLE_SESSIONS=0 lets a new conversation go as soon as it is made: an edit of a later turn (a branch
    of another conversation) then starts without the source's KV, not with a 500."""
    service = make_service(tiers=("dram",), max_idle_sessions=0)

    async def ask(messages):
        _, _, events = await service.chat(messages, TurnRequest("", max_tokens=3))
        async for event in events:
            pass
        return event

    async def scenario():
        first = [{"role": "user", "content": "Hello, how are you today?"}]
        answer = (await ask(first)).content
        second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me about Rome."}]
        await ask(second)
        edited = second[:-1] + [{"role": "user", "content": "Tell me about Carthage."}]
        assert (await ask(edited)).completion_tokens > 0
        assert service.history.count(DEFAULT_TENANT) == 2

    asyncio.run(scenario())


def test_a_new_conversation_whose_client_leaves_while_its_turn_is_saved_is_kept(make_service, monkeypatch):
    """The turn committed (the history is the source of truth): the client saw the reply streamed, and a
    resend of it finds the conversation again, though the result never reached it."""
    import threading

    from tests.statekeeper.sessions.test_service import _slowed, cancelled_while_saving

    service = make_service(tiers=("dram",))
    saving = threading.Event()
    monkeypatch.setattr(service.history, "commit_turn", _slowed(service.history.commit_turn, saving))

    async def ask():
        _, _, events = await service.chat(MESSAGES, TurnRequest("", max_tokens=3))
        async for _ in events:
            pass

    async def scenario():
        await cancelled_while_saving(asyncio.create_task(ask()), saving)
        assert service.history.count(DEFAULT_TENANT) == 1

    asyncio.run(scenario())
