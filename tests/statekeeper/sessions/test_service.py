"""Session lifecycle under clients that go away (statekeeper/sessions/service.py)."""

import asyncio
import threading
import time

import pytest

from statekeeper.sessions import SessionError, SessionNotFound, TurnRequest


async def _turn(service, session, content, max_tokens=5):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


def _slowed(fn, started: threading.Event, seconds: float = 0.3):
    """`fn` taking `seconds` longer (in its thread); `started` is set as a call begins."""
    def slow(*args):
        started.set()
        time.sleep(seconds)
        return fn(*args)

    return slow


async def cancelled_while_saving(task: asyncio.Task, saving: threading.Event) -> None:
    """Cancels `task` once its turn's save has begun (the client disconnects then) and waits for it."""
    while not saving.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def test_a_client_leaving_while_its_turn_is_saved_loses_nothing(make_service, monkeypatch):
    """Issue 14 item 2: the save commits in its thread even when the turn's task is cancelled; memory
    must follow the committed history, or the next turn overwrites the one that was saved."""
    service = make_service(tiers=("dram",))
    saving = threading.Event()
    original = service.history.commit_turn
    slow_save = _slowed(original, saving)

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for name in (session, twin):
            await _turn(service, name, "Hello there.")
        await _turn(service, twin, "What is the capital of France?")
        monkeypatch.setattr(service.history, "commit_turn", slow_save)
        await cancelled_while_saving(asyncio.create_task(_turn(service, session, "What is the capital of France?")),
                                     saving)
        monkeypatch.setattr(service.history, "commit_turn", original)
        result = await _turn(service, session, "And of Italy?")
        stored = service.history.load(session)
        users = [m["content"] for m in stored.messages if m["role"] == "user"]
        assert users == ["Hello there.", "What is the capital of France?", "And of Italy?"]
        assert [m["content"] for m in await service.messages(session)] == [m["content"] for m in stored.messages]
        # The KV kept matching the saved history: the next turn is the one a never-cancelled twin runs.
        expected = await _turn(service, twin, "And of Italy?")
        assert (result.content, result.prompt_tokens, result.cached_tokens) == (
            expected.content, expected.prompt_tokens, expected.cached_tokens)
        assert result.restore_source == "active"

    asyncio.run(scenario())


def test_a_deleted_session_does_not_come_back(make_service, monkeypatch):
    """Issue 14 item 3: a request arriving while the delete runs must not reload the conversation
    from the history it is being deleted from, nor save it again."""
    service = make_service(tiers=("dram",))
    deleting = threading.Event()
    monkeypatch.setattr(service.history, "delete", _slowed(service.history.delete, deleting))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello there.")
        deletion = asyncio.create_task(service.delete(session))
        while not deleting.is_set():
            await asyncio.sleep(0.005)
        with pytest.raises(SessionNotFound):
            await _turn(service, session, "Are you still there?")
        await deletion
        assert service.history.load(session) is None
        with pytest.raises(SessionNotFound):
            await service.view(session)

    asyncio.run(scenario())


def test_a_turn_whose_save_fails_leaves_history_and_kv_as_they_were(make_service, monkeypatch):
    service = make_service(tiers=("dram",))
    original = service.history.commit_turn

    def full_disk(conversation, expected_turns, fence=None):
        raise OSError(28, "No space left on device")

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for name in (session, twin):
            await _turn(service, name, "Hello there.")
        monkeypatch.setattr(service.history, "commit_turn", full_disk)
        with pytest.raises(SessionError) as refused:
            await _turn(service, session, "What is the capital of France?")
        assert refused.value.status == 507  # Insufficient Storage, not a 500
        monkeypatch.setattr(service.history, "commit_turn", original)
        assert [m["content"] for m in await service.messages(session)] == [
            m["content"] for m in service.history.load(session).messages]
        retried = await _turn(service, session, "What is the capital of France?")
        expected = await _turn(service, twin, "What is the capital of France?")
        assert (retried.content, retried.cached_tokens) == (expected.content, expected.cached_tokens)

    asyncio.run(scenario())


def test_a_full_history_store_refuses_with_507_and_loses_nothing(make_service, tmp_path):
    """A real full LMDB map under the history: creating and saving turns is refused with 507, what was
    saved stays, and once there is room again the refused turn runs as it would have."""
    from statekeeper.history import LmdbHistory

    service = make_service(tiers=("dram",), history=LmdbHistory(tmp_path / "tiny-history", map_size=256 << 10))

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for name in (session, twin):
            await _turn(service, name, "Hello there.")
        fillers = []
        for pad in (8000, 100):  # big fillers, then small ones into what is left
            with pytest.raises(SessionError) as refused:
                for _ in range(1000):
                    fillers.append((await service.create("x" * pad, {"pad": "y" * pad})).id)
            assert refused.value.status == 507
        saved = service.history.load(session)
        with pytest.raises(SessionError) as refused:
            await _turn(service, session, "Tell me about Rome. " * 30, max_tokens=5)
        assert refused.value.status == 507
        with pytest.raises(SessionError) as refused:  # a conversation's retention: the same refusal (it was a 500)
            await service.set_retention(session, {"pinned": True, "priority": "high", "ttl_seconds": 86_400 * 300})
        assert refused.value.status == 507
        assert service.history.load(session) == saved
        assert [m["content"] for m in await service.messages(session)] == [m["content"] for m in saved.messages]
        for filler in fillers[: len(fillers) // 2]:
            await service.delete(filler)
        retried = await _turn(service, session, "What is the capital of France?")
        expected = await _turn(service, twin, "What is the capital of France?")
        assert (retried.content, retried.cached_tokens) == (expected.content, expected.cached_tokens)

    asyncio.run(scenario())


def test_a_turn_reports_what_its_first_token_waited_for(make_service):
    """Where a slow first token went: in line for the model thread behind other work, or waiting for the
    session that another request holds. (With one model thread: a long lane would take the prompt meanwhile.)"""
    service = make_service(long_prefill_lane="off")

    async def scenario():
        session = (await service.create(None, None)).id
        quiet = await _turn(service, session, "Hello there.")
        busy = asyncio.ensure_future(service.executors.in_model_thread(time.sleep, 0.4))  # another user's long step
        await asyncio.sleep(0.05)
        queued = await _turn(service, session, "And then?")
        await busy
        live = await service.get_live(session)
        async with live.lock:  # another request holds the session for a while
            held = asyncio.ensure_future(_turn(service, session, "Go on."))
            await asyncio.sleep(0.3)
        locked = await held
        return quiet, queued, locked

    quiet, queued, locked = asyncio.run(scenario())
    assert quiet.first_queue_ms < 100 and quiet.lock_wait_ms < 100
    assert queued.first_queue_ms >= 250 and queued.lock_wait_ms < 100
    assert locked.lock_wait_ms >= 250


def test_a_restore_does_not_wait_behind_background_io(make_service):
    """The I/O threads also write offloads and compressed blobs: a returning user's read must not queue
    behind them (the multi-user tail of issue 13)."""
    service = make_service(tiers=("dram",))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello there.")
        await service.offload(session)
        background = [asyncio.ensure_future(service.in_io_thread(time.sleep, 0.6)) for _ in range(4)]
        await asyncio.sleep(0.05)  # every I/O thread is busy with background work
        result = await _turn(service, session, "And then?")
        await asyncio.gather(*background)
        return result

    result = asyncio.run(scenario())
    assert result.restore_source == "dram" and result.restore_ms < 300
