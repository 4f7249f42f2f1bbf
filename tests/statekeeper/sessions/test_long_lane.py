"""A prompt longer than one prefill chunk runs on the long lane (scheduler/lanes.py), a model thread of its
own: another user's short turn gets its first token while that prompt's chunk is still running, and both
replies are the ones they get with one model thread. A short prompt takes the long lane too while the model
thread is busy."""

import asyncio
import threading

import pytest

from statekeeper.sessions import TurnRequest

LONG_PROMPT = "Tell me everything about the long history of the Roman empire, please. " * 12
SHORT_PROMPT = "Hi"


async def _turn(service, session, content, max_tokens=8):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


async def _first_token(service, session, content):
    events = service.turn(session, TurnRequest(content, max_tokens=8))
    first = await anext(events)
    async for event in events:
        pass
    return first, event


def _hold_long_chunks(service, monkeypatch, chunk_tokens):
    """Makes every forward that carries a full chunk beyond the first of a prompt wait until `released` is set;
    `held` is set when one does."""
    held, released = threading.Event(), threading.Event()
    step = service.worker.step

    def gated(segments):
        if any(len(segment.token_ids) == chunk_tokens and segment.cache.num_tokens >= chunk_tokens
               for segment in segments):
            held.set()
            released.wait(30)
        return step(segments)

    monkeypatch.setattr(service.worker, "step", gated)
    return held, released


def test_a_short_turn_gets_its_first_token_while_a_long_prompt_is_mid_chunk(make_service, monkeypatch):
    service = make_service(tiers=("dram",), long_prefill_lane="on")
    chunk = service.worker.config.prefill_chunk_tokens
    assert len(service.formatter.encode(LONG_PROMPT)) > 2 * chunk
    held, released = _hold_long_chunks(service, monkeypatch, chunk)

    async def scenario():
        long_session, short_session = [(await service.create("be brief", None)).id for _ in range(2)]
        long_turn = asyncio.create_task(_turn(service, long_session, LONG_PROMPT))
        assert await asyncio.to_thread(held.wait, 30), "the long prompt never reached its second chunk"
        try:
            # With one model thread this waits for the held chunk: the forward under way when it came.
            first, short = await asyncio.wait_for(_first_token(service, short_session, SHORT_PROMPT), 15)
            assert not released.is_set()
        finally:
            released.set()
        long = await long_turn
        return short, long, service.stats()["long_prefill_lane"]

    short, long, lane = asyncio.run(scenario())
    assert short.completion_tokens > 0 and long.prompt_tokens > 2 * chunk
    assert lane["live_jobs"] >= 1  # the long prompt's prefill ran there


def test_a_short_prompt_gets_its_first_token_on_the_long_lane_while_the_model_thread_is_busy(make_service):
    service = make_service(tiers=("dram",), long_prefill_lane="on")
    released = threading.Event()

    async def scenario():
        session = (await service.create("be brief", None)).id
        busy = asyncio.ensure_future(service.executors.in_model_thread(released.wait, 30))  # another user's work
        try:
            events = service.turn(session, TurnRequest(SHORT_PROMPT, max_tokens=4))
            await asyncio.wait_for(anext(events), 15)  # its prompt's forward ran while the model thread is held
            assert not released.is_set()
        finally:
            released.set()
        async for event in events:
            pass
        await busy
        return event, service.stats()["long_prefill_lane"]

    result, lane = asyncio.run(scenario())
    assert result.completion_tokens > 0 and lane["live_jobs"] == 1


def test_replies_and_kv_are_the_same_on_the_long_lane_as_on_one_model_thread(make_service, tmp_path):
    results = {}
    for setting in ("off", "on"):
        service = make_service(tiers=("dram",), data_dir=tmp_path / setting, long_prefill_lane=setting)

        async def scenario():
            long_session, short_session = [(await service.create("be brief", None)).id for _ in range(2)]
            # One at a time: batched beside each other, decode rows ride other rows' matrix products, whose
            # rounding depends on the rows (BENCHMARKS.md "Batch invariance"); that is not the lane's doing.
            replies = [await _turn(service, long_session, LONG_PROMPT, max_tokens=16),
                       await _turn(service, short_session, SHORT_PROMPT, max_tokens=16)]
            score = await service.score(short_session, [{"role": "user", "content": LONG_PROMPT},
                                                        {"role": "assistant", "content": LONG_PROMPT}])
            layers = service.in_memory(long_session).cache.export_layers()
            return [r.content for r in replies], [(t.token, t.logprob) for t in score.tokens], layers

        results[setting] = asyncio.run(scenario())
        lane = service.stats()["long_prefill_lane"]
        assert (lane is None) == (setting == "off")
        if setting == "on":
            assert lane["live_jobs"] >= 2  # the long prompt and the scoring
    (replies_off, scores_off, kv_off), (replies_on, scores_on, kv_on) = results["off"], results["on"]
    assert replies_on == replies_off
    assert scores_on == scores_off
    assert all(k1.equal(k2) and v1.equal(v2) for (k1, v1), (k2, v2) in zip(kv_off, kv_on))


@pytest.mark.parametrize(("setting", "device", "threads", "cores", "expected"), [
    ("on", "cuda", 4, 1, True), ("off", "cpu", 1, 64, False),
    ("auto", "cpu", 1, 2, True), ("auto", "cpu", 2, 3, False), ("auto", "cpu", 2, 4, True), ("auto", "cuda", 1, 64, False),
])
def test_auto_takes_the_long_lane_where_a_core_is_spare(monkeypatch, setting, device, threads, cores, expected):
    from scheduler.lanes import wants_long_lane
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    assert wants_long_lane(setting, device, threads) is expected
