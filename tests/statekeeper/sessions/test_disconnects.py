"""A client that leaves at any point of a streamed turn (issue 14's fault list): between two events, or
while the model works on its turn. Afterwards the history is what the client was told (the turn is
either not there or there whole), and the session's KV matches it: its next turn is token for token the
one a twin with the same history gets."""

import asyncio
import threading
import time

import anyio
import pytest

from statekeeper.sessions import TurnRequest

MAX_TOKENS = 4


async def _turn(service, session, content, max_tokens=MAX_TOKENS):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


async def _users(service, session) -> list[str]:
    return [m["content"] for m in await service.messages(session) if m["role"] == "user"]


async def _next_turns_agree(service, session, twin) -> None:
    """Brings the twin to the session's committed history, then compares one more turn on each."""
    if await _users(service, session) != await _users(service, twin):
        await _turn(service, twin, "What is the capital of France?")
    assert await _users(service, session) == await _users(service, twin)
    ours, theirs = [await _turn(service, name, "And of Italy?") for name in (session, twin)]
    assert (ours.content, ours.prompt_tokens, ours.cached_tokens) == (
        theirs.content, theirs.prompt_tokens, theirs.cached_tokens)


@pytest.mark.parametrize("events_read", range(MAX_TOKENS + 1))
def test_a_client_leaving_between_events_loses_nothing(make_service, events_read):
    service = make_service(tiers=("dram",))

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for name in (session, twin):
            await _turn(service, name, "Hello there.")
        stream = service.turn(session, TurnRequest("What is the capital of France?", max_tokens=MAX_TOKENS))
        for _ in range(events_read):
            await anext(stream)
        await stream.aclose()  # what the server does with a response whose client has gone
        users = await _users(service, session)
        assert users in (["Hello there."], ["Hello there.", "What is the capital of France?"])
        await _next_turns_agree(service, session, twin)

    asyncio.run(scenario())


async def _leaves(turn, reached: threading.Event, how: str) -> None:
    """Runs `turn` and cancels it once `reached` is set: once (a task cancelled), or as uvicorn reports a client
    that left, through anyio's cancel scope, which cancels the request's task again at each of its awaits."""
    if how == "anyio scope":
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: turn)
            while not reached.is_set():
                await asyncio.sleep(0.005)
            group.cancel_scope.cancel()
        return
    task = asyncio.create_task(turn)
    while not reached.is_set():
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("how", ["task cancelled", "anyio scope"])
@pytest.mark.parametrize("model_calls", [1, 2, MAX_TOKENS])
def test_a_client_leaving_while_the_model_works_loses_nothing(make_service, monkeypatch, model_calls, how):
    """Cancelled while its turn's prefill or a decode step runs on the model thread. Cancelled again at each
    await (uvicorn), the turn stopped waiting for the forward and rolled the KV back while it still wrote: the
    forward's row landed past the history, and the next turn read it."""
    service = make_service(tiers=("dram",))
    worker, calls, reached = service.worker, [0], threading.Event()
    step = worker.step

    def counted(fn):
        def call(*args):
            calls[0] += 1
            if calls[0] == model_calls:
                reached.set()
                threading.Event().wait(0.2)  # still running when the client leaves
            return fn(*args)
        return call

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for name in (session, twin):
            await _turn(service, name, "Hello there.")
        monkeypatch.setattr(worker, "step", counted(step))
        await _leaves(_turn(service, session, "What is the capital of France?"), reached, how)
        await asyncio.sleep(0.3)  # the forward has ended
        monkeypatch.setattr(worker, "step", step)
        assert await _users(service, session) == ["Hello there."]  # never told of a reply: not committed
        await _next_turns_agree(service, session, twin)

    asyncio.run(scenario())


@pytest.mark.parametrize("where", ["decode step", "commit"])
def test_a_turn_whose_client_left_under_uvicorn_waits_for_its_work_without_a_busy_loop(make_service, monkeypatch,
                                                                                      where):
    """uvicorn's cancel scope cancels the request's task again at each turn of the event loop: a turn that waited
    for its decode step (or its commit) through that caught each cancel and awaited again, a busy loop at a whole
    core that starved the model thread of the GIL (a 0.1 s step took 12 s at a shutdown)."""
    service = make_service(tiers=("dram",))
    reached, spent, calls = threading.Event(), [], [0]
    owner, name = (service.worker, "step") if where == "decode step" else (service.history, "commit_turn")
    work = getattr(owner, name)

    def slow_second_call(*args):
        calls[0] += 1
        if calls[0] == 2:
            reached.set()
            started = time.process_time()  # every thread's: the event loop's while this one sleeps
            time.sleep(0.4)
            spent.append(time.process_time() - started)
        return work(*args)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello there.")
        calls[0] = 0 if where == "decode step" else 1  # the commit: this turn's is the second
        monkeypatch.setattr(owner, name, slow_second_call)
        await _leaves(_turn(service, session, "What is the capital of France?"), reached, "anyio scope")
        await asyncio.sleep(0.5)

    asyncio.run(scenario())
    assert spent and spent[0] < 0.15  # a busy loop spent about all of the 0.4 s


def test_a_turn_whose_save_fails_after_its_client_left_under_uvicorn_ends_quietly(make_service, monkeypatch):
    """The commit waits shielded from uvicorn's cancel, which it then no longer saw: a save that failed after the
    client left raised its refusal (a 503) into the cancelled request, an error for a client long gone."""
    from statekeeper.history import HistoryUnavailable

    service = make_service(tiers=("dram",))
    reached = threading.Event()

    def fails_slowly(*args):
        reached.set()
        time.sleep(0.2)
        raise HistoryUnavailable("the history database does not answer")

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello there.")
        monkeypatch.setattr(service.history, "commit_turn", fails_slowly)
        await _leaves(_turn(service, session, "What is the capital of France?"), reached, "anyio scope")
        monkeypatch.undo()
        assert await _users(service, session) == ["Hello there."]

    asyncio.run(scenario())


def test_a_scoring_whose_client_left_while_it_waited_in_line_never_runs(make_service, monkeypatch):
    """A live model job (a scoring's forward over the whole conversation) whose client left while it waited in
    line for the model thread still ran, at live priority, and held its conversation until it had."""
    service = make_service(tiers=("dram",), long_prefill_lane="off")  # one lane: the job waits behind the step
    gate, busy, scored = threading.Event(), threading.Event(), []
    step, score = service.worker.step, service.worker.score

    def held_step(*args):
        busy.set()
        gate.wait(10)
        return step(*args)

    async def scenario():
        first, second = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (first, second):
            await _turn(service, session, "Hello there.")
        monkeypatch.setattr(service.worker, "score", lambda *args: scored.append(1) or score(*args))
        monkeypatch.setattr(service.worker, "step", held_step)
        holding = asyncio.ensure_future(_turn(service, first, "And then?"))  # the model thread at its step
        while not busy.is_set():
            await asyncio.sleep(0.005)
        messages = [{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."}]
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: service.score(second, messages))
            await asyncio.sleep(0.3)  # its forward in line behind the step
            group.cancel_scope.cancel()  # the client left
        gate.set()
        await holding

    asyncio.run(scenario())
    assert scored == []


def test_a_turn_committed_while_its_client_leaves_is_recorded_as_a_turn(make_service, monkeypatch):
    """The save commits whatever the client does (the history keeps the turn), but a client that left during
    it skipped what follows a commit: the turn was in no metric or trace, and the placement policy never
    heard the conversation go idle again (its TTL still ran from the turn before)."""
    service = make_service(tiers=("dram",))
    commit, entered, release = service.history.commit_turn, threading.Event(), threading.Event()

    def slow_commit(*args, **kwargs):
        entered.set()
        release.wait(10)
        return commit(*args, **kwargs)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello there.")
        recorded = len(service.feed.recent)
        monkeypatch.setattr(service.history, "commit_turn", slow_commit)
        task = asyncio.ensure_future(_turn(service, session, "And then?"))
        await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await _users(service, session) == ["Hello there.", "And then?"]  # committed ...
        assert len(service.feed.recent) == recorded + 1  # ... and recorded as a turn

    asyncio.run(scenario())
