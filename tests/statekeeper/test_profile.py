import asyncio

from scheduler.plan import ComputeProfile, LoadProfile
from statekeeper.profile import HardwareProfile, load_or_measure, profile_path
from statekeeper.sessions import TurnRequest

TURNS = ["Tell me about the history of Rome and its emperors, from the founding to the fall. " * 3, "And then?"]


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=8)):
        pass
    return event


def test_a_quick_profile_is_measured_once_then_loaded(tiny_worker, make_service, tmp_path):
    service = make_service(tiers=("dram", "lmdb"))
    profile = load_or_measure(tmp_path, tiny_worker, service.tiers.tiers)
    assert set(profile.tiers) == {"dram", "lmdb"} and profile.model == tiny_worker.fingerprint
    assert profile.compute.prefill_ms(256) > 0 and all(t.megabytes_per_s > 0 for t in profile.tiers.values())
    assert profile_path(tmp_path, tiny_worker).exists()
    assert HardwareProfile.from_json(profile.to_json()) == profile
    assert load_or_measure(tmp_path, tiny_worker, []) == profile  # cached: no tier is measured again
    assert not any(service.tiers.tiers[1].keys())  # the probe blobs are gone


def test_a_slow_tier_restores_through_the_pipeline_with_the_same_reply(make_service):
    service = make_service(tiers=("lmdb",))
    service.loader.hardware = HardwareProfile(service.worker.fingerprint, "cpu", 1, ComputeProfile(0.0, 0.5, 0.0),
                                       {"lmdb": LoadProfile(latency_ms=1.0, megabytes_per_s=5.0)})

    async def scenario():
        piped, hot = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (piped, hot):
            await _turn(service, session, TURNS[0])
        await service.offload(piped)
        restored, reference = await _turn(service, piped, TURNS[1]), await _turn(service, hot, TURNS[1])
        assert restored.restore_source == "lmdb" and restored.content == reference.content
        pipeline = restored.restore_pipeline
        assert 0 < pipeline["recompute_tokens"] < pipeline["tokens"] and pipeline["fallback"] is None
        assert pipeline["measured"]["total_ms"] > 0 and 0 <= pipeline["bubble_fraction"] <= 1

    asyncio.run(scenario())


def test_when_recomputing_everything_is_faster_the_blob_is_kept_but_not_read(make_service):
    service = make_service(tiers=("lmdb",))
    service.loader.hardware = HardwareProfile(service.worker.fingerprint, "cpu", 1, ComputeProfile(0.0, 0.001, 0.0),
                                       {"lmdb": LoadProfile(latency_ms=50.0, megabytes_per_s=0.01)})

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        await service.offload(session)
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "recompute" and result.restore_pipeline is None
        assert service.tiers.locate(session) == "lmdb"

    asyncio.run(scenario())


def test_a_service_built_with_planning_measures_its_profile_at_start(make_service, tmp_path):
    service = make_service(tiers=("dram", "lmdb"), data_dir=tmp_path / "planned", restore_planning=True)
    assert service.loader.hardware is not None and set(service.loader.hardware.tiers) == {"dram", "lmdb"}
    assert (tmp_path / "planned" / "profiles").is_dir()


def test_a_tier_that_fetches_whole_blobs_is_never_split(make_service, redis_server, redis_prefix):
    service = make_service(tiers=("redis",))
    service.loader.hardware = HardwareProfile(service.worker.fingerprint, "cpu", 1, ComputeProfile(0.0, 0.5, 0.0),
                                       {"redis": LoadProfile(latency_ms=1.0, megabytes_per_s=5.0)})

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        await service.offload(session)
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "redis" and result.restore_pipeline is None

    asyncio.run(scenario())


def test_under_load_a_slow_tier_is_read_whole_and_nothing_is_recomputed_on_the_model_thread(make_service):
    """The plan's recompute runs on the model thread as one job that every other user's step waits behind;
    with other work on that thread, the blob is read whole instead (its reading costs only this turn)."""
    import time

    service = make_service(tiers=("lmdb",))
    service.loader.hardware = HardwareProfile(service.worker.fingerprint, "cpu", 1, ComputeProfile(0.0, 0.5, 0.0),
                                       {"lmdb": LoadProfile(latency_ms=1.0, megabytes_per_s=5.0)})

    async def scenario():
        loaded, hot = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (loaded, hot):
            await _turn(service, session, TURNS[0])
        await service.offload(loaded)
        busy = asyncio.ensure_future(service.executors.in_model_thread(time.sleep, 0.3))  # another user's work
        await asyncio.sleep(0.05)
        restored = await _turn(service, loaded, TURNS[1])
        await busy
        reference = await _turn(service, hot, TURNS[1])
        assert restored.restore_source == "lmdb" and restored.restore_pipeline is None
        assert restored.content == reference.content and restored.cached_tokens == reference.cached_tokens

    asyncio.run(scenario())


def test_a_profile_measured_under_other_kernels_is_measured_again(tiny_worker, tmp_path, monkeypatch):
    """The restore profile was read whatever machine had measured it (its file named no CPU): a data directory
    moved to another host planned restores by the first one's speeds."""
    import statekeeper.profile as profile

    measured = []
    measure_compute = profile.measure_compute
    monkeypatch.setattr(profile, "measure_compute", lambda *args: measured.append(1) or measure_compute(*args))
    load_or_measure(tmp_path, tiny_worker, [])
    load_or_measure(tmp_path, tiny_worker, [])
    assert len(measured) == 1
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # another machine, as far as the kernels go
    load_or_measure(tmp_path, tiny_worker, [])
    assert len(measured) == 2


def test_a_tier_missing_from_the_kept_profile_is_measured_at_the_next_start(tiny_worker, tmp_path):
    """A tier that could not be read at the first start (Redis still starting), or one added since, stayed out
    of the kept profile for good: its restores were never planned, and placement took its reads as free."""
    from storage.dram import DramTier

    class Unreachable(DramTier):
        def put(self, key, blob):
            raise ConnectionError("not up yet")

    assert load_or_measure(tmp_path, tiny_worker, [Unreachable(64 << 20)]).tiers == {}
    assert set(load_or_measure(tmp_path, tiny_worker, [DramTier(64 << 20)]).tiers) == {"dram"}
    assert set(load_or_measure(tmp_path, tiny_worker, []).tiers) == {"dram"}  # kept


def test_a_profile_file_that_parses_but_is_not_a_profile_is_measured_again(tiny_worker, tmp_path):
    """`"tiers": []` raised AttributeError out of the start."""
    import json

    from statekeeper.machine import machine_id

    good = load_or_measure(tmp_path, tiny_worker, [])
    path = profile_path(tmp_path, tiny_worker)
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data | {"cpu": machine_id(), "tiers": []}))
    assert load_or_measure(tmp_path, tiny_worker, []).model == good.model


def test_the_profile_command_keeps_its_profile_where_the_service_looks_for_it(tiny_model_dir, tmp_path, monkeypatch):
    """`statekeeper profile` loaded the model without the configured dtype (and device): its profile was kept
    under another worker's fingerprint than the service's, which never found it and measured a quick one at
    every fresh start."""
    from statekeeper.service_worker import load_service_worker
    from statekeeper.cli import main
    from statekeeper.profile import profile_path
    from statekeeper.settings import load_settings

    monkeypatch.setenv("STATEKEEPER_DTYPE", "bfloat16")
    main(["profile", "--data-dir", str(tmp_path), "--model", str(tiny_model_dir), "--lengths", "16,32,64"])
    config = load_settings(data_dir=str(tmp_path), model=str(tiny_model_dir)).to_config()
    worker, _, _ = load_service_worker(config)
    assert profile_path(config.profile_dir, worker).exists()


def test_a_profile_timed_on_other_many_row_products_is_measured_again(smollm2_worker, tmp_path, monkeypatch):
    """A restart with GEMM_ROWS set (or a new measured crossover) sends a prefill's rows to another product than
    the kept profile was timed on; the profile was kept all the same, and restores planned by the old speeds."""
    import statekeeper.profile as profile
    from kernels.weight_linear import WeightOnlyLinear, use_dense_from_rows

    measured = []
    measure_compute = profile.measure_compute
    monkeypatch.setattr(profile, "measure_compute",
                        lambda worker, *args: measured.append(1) or measure_compute(worker, (8, 16, 32), 1))
    rows = next(m.dense_from_rows for m in smollm2_worker.model.modules() if isinstance(m, WeightOnlyLinear))
    load_or_measure(tmp_path, smollm2_worker, [])
    load_or_measure(tmp_path, smollm2_worker, [])
    assert len(measured) == 1
    use_dense_from_rows(smollm2_worker.model.modules(), rows + 1_000)  # every prefill chunk on the kernel
    try:
        load_or_measure(tmp_path, smollm2_worker, [])
    finally:
        use_dense_from_rows(smollm2_worker.model.modules(), rows)
    assert len(measured) == 2
