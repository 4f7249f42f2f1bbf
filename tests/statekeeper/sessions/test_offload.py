"""Going inactive stores the exact state at once; compression comes later, in the background, off every
returning user's path (statekeeper/sessions/offload.py)."""

import asyncio
import time

import pytest

from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest

LONG = "Tell me everything you know about the history of the Roman Empire and its emperors. " * 12
TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?"]
KVZIP_INT4 = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4-rot-g32-s1")


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


def _slow_reconstruction(monkeypatch, worker, seconds: float) -> list[tuple[float, float]]:
    """Each KVzip scoring step takes `seconds` longer; returns the steps' (start, end) times."""
    steps = []
    original = worker.reconstruction_step

    def slow_step(*args):
        start = time.monotonic()
        time.sleep(seconds)
        original(*args)
        steps.append((start, time.monotonic()))

    monkeypatch.setattr(worker, "reconstruction_step", slow_step)
    return steps


def test_offload_stores_the_exact_state_and_compression_comes_later(make_service):
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=3600,
                           compress_quiet_seconds=0)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, LONG)
        exact = await service.offload(session)
        assert (exact.is_compressed, exact.codec) == (False, "none")
        await service.compress_due()  # not idle long enough yet, nor short of room
        assert service.compactor.counters.compressed == 0 and service.compactor.report()["queued"] == 1
        service.config.compress_after_seconds = 0
        await service.compress_due()
        compressed = await service.view(session)
        assert compressed.is_compressed and compressed.codec == "int4-rot-g32-s1"
        assert compressed.stored_bytes < 0.2 * exact.stored_bytes
        report = service.compactor.report()  # what /metrics exports as the compression ratio
        assert (report["raw_bytes"], report["stored_bytes"]) == (exact.stored_bytes, compressed.stored_bytes)
        assert (await _turn(service, session, TURNS[1])).restore_source == "dram"

    asyncio.run(scenario())


def test_a_turn_arriving_during_compression_cancels_it_and_is_not_delayed(make_service, monkeypatch):
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0, compress_chunk_tokens=16)
    step_seconds = 0.3
    steps = _slow_reconstruction(monkeypatch, service.worker, step_seconds)

    async def scenario():
        session = (await service.create(None, None)).id
        twin = (await service.create(None, None, {"policy": "none", "codec": "none"})).id
        for name in (session, twin):
            await _turn(service, name, LONG)
        await service.offload(session)
        compression = asyncio.create_task(service.compress_due())
        while len(steps) < 2:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        restored = await _turn(service, session, TURNS[1])
        elapsed = time.monotonic() - started
        await compression
        # It waited for at most the one scoring step under way, not for the ~40 steps left.
        assert elapsed < 2 * step_seconds + 0.5
        assert len(steps) <= 4
        assert service.compactor.counters.cancelled == 1 and service.compactor.counters.compressed == 0
        # Restored from the exact blob: the same reply as the session that never left memory.
        assert restored.restore_source == "dram"
        assert restored.content == (await _turn(service, twin, TURNS[1])).content
        view = await service.offload(session)
        assert view.is_compressed is False and service.compactor.report()["queued"] == 1

    asyncio.run(scenario())


def test_a_restored_compressed_session_offloaded_without_a_new_turn_keeps_its_blob(make_service):
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, LONG)
        await service.offload(session)
        await service.compress_due()
        stored = await service.view(session)
        assert stored.is_compressed
        score = await service.score(session, [{"role": "user", "content": "Hi"},
                                              {"role": "assistant", "content": "Hello."}])
        assert score.restore_source == "dram"  # restored from the compressed blob, no new turn
        again = await service.offload(session)
        assert (again.tier, again.stored_bytes, again.is_compressed) == ("dram", stored.stored_bytes, True)
        assert service.compactor.report()["queued"] == 0  # nothing to compress again
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "dram" and result.completion_tokens == 10

    asyncio.run(scenario())


def test_compression_never_starts_while_a_turn_runs(make_service, monkeypatch):
    quiet = 0.2
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=quiet, compress_chunk_tokens=32)
    steps = _slow_reconstruction(monkeypatch, service.worker, 0.01)

    async def scenario():
        idle = (await service.create(None, None)).id
        busy = (await service.create(None, None, {"policy": "none", "codec": "none"})).id
        await _turn(service, idle, LONG)
        await service.offload(idle)
        compression = asyncio.create_task(service.compress_due())
        turns = []
        for content in TURNS * 3:  # back to back: the gaps between them are shorter than `quiet`
            start = time.monotonic()
            await _turn(service, busy, content)
            turns.append((start, time.monotonic()))
        await compression
        assert service.compactor.counters.compressed == 1  # it ran once the turns stopped
        for step_start, _ in steps:
            assert not any(start <= step_start <= end + quiet * 0.9 for start, end in turns)

    asyncio.run(scenario())


@pytest.mark.parametrize("tiers", [("dram", "lmdb")])
def test_a_blob_demoted_below_the_fastest_tier_is_due_for_compression(make_service, tiers):
    service = make_service(tiers=tiers, compression=KVZIP_INT4, compress_after_seconds=3600,
                           compress_quiet_seconds=0)

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, LONG)
        await service.offload(session)
        blob = bytes(service.tiers.tier("dram").get(session))
        assert service.tiers.put(session, blob, tier="lmdb") == "lmdb"  # as memory pressure demotes it
        await service.compress_due()
        view = await service.view(session)
        assert view.is_compressed and service.compactor.counters.compressed == 1

    asyncio.run(scenario())


def test_shutdown_stores_exact_states_and_never_scores_and_the_next_start_compresses_them(make_service, monkeypatch,
                                                                                          tmp_path):
    options = {"tiers": ("lmdb",), "compression": KVZIP_INT4, "compress_after_seconds": 0, "compress_quiet_seconds": 0,
               "data_dir": tmp_path / "data"}
    service = make_service(**options)
    steps = _slow_reconstruction(monkeypatch, service.worker, 0.0)

    async def scenario():
        sessions = [(await service.create(None, None)).id for _ in range(2)]
        for session in sessions:
            await _turn(service, session, LONG)
        await service.start()
        await service.stop()

    asyncio.run(scenario())
    assert steps == [] and service.stats()["model_thread"]["background_jobs"] == 0
    restarted = make_service(**options)
    assert restarted.compactor.report()["queued"] == 2
    asyncio.run(restarted.compress_due())
    assert restarted.compactor.counters.compressed == 2 and len(steps) > 0


@pytest.mark.parametrize("copies", [False, True])
def test_going_inactive_asks_redis_to_delete_an_exact_copy_only_where_copies_are_kept(make_service, redis_server,
                                                                                     copies):
    """Each offload deleted the conversation's exact-copy key in every shared tier (a meta read and a DEL in
    Redis) even where no copy is ever kept (EXACT_COPY_TIER unset); where copies are kept, the stale one goes."""
    import redis

    options = {"compression": KVZIP_INT4, "exact_copy_tier": "redis"} if copies else {}
    service = make_service(tiers=("dram", "redis"), **options)
    client = redis.Redis.from_url(redis_server.url)

    def deletes() -> int:  # a delete takes the record with GETDEL, the chunks with DEL
        stats = client.info("commandstats")
        return sum(stats.get(f"cmdstat_{command}", {}).get("calls", 0) for command in ("del", "getdel"))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        before = deletes()
        await service.offload(session)
        assert service.tiers.locate(session) == "dram"
        assert (deletes() - before > 0) == copies

    asyncio.run(scenario())


def test_a_blob_the_compactor_leaves_as_it_is_keeps_its_value(make_service, tmp_path):
    """The compactor marks a blob as compressing (valued at the size it is about to have) before it starts;
    one it then skipped (a lossless conversation queued at a restart, as every stored blob is) or failed on
    stayed marked for good: valued as if eight times smaller, it outranked the blobs a full tier should keep."""
    lossless = CompressionConfig(policy="none", codec="none")
    options = {"tiers": ("lmdb",), "compression": lossless, "data_dir": tmp_path / "data"}
    service = make_service(**options)

    async def stored():
        session = (await service.create(None, None)).id
        await _turn(service, session, LONG)
        await service.offload(session)
        service.close()
        return session

    session = asyncio.run(stored())
    restarted = make_service(**options)
    policy, later = restarted.placement_policy, time.time() + 3_600.0  # idle an hour: worth compressing by now
    policy.clock = lambda: later
    size = restarted.tiers.stored_bytes(session)
    before = policy.value(0, session, size, later)
    assert restarted.compactor.report()["queued"] == 1
    asyncio.run(restarted.compress_due())
    assert restarted.compactor.counters.skipped == 1
    assert policy.value(0, session, size, later) == before
