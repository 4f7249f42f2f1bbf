"""Compression in a child process (statekeeper/sessions/compress_process.py): the model thread that
serves turns does none of it, the blob it stores restores like one compressed on the model thread,
and a turn that arrives meanwhile is neither delayed nor answered from the half-made state."""

import asyncio
import time

import torch

from statekeeper.config import WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.sessions import TurnRequest
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE
from tests.statekeeper.sessions.test_offload import KVZIP_INT4, LONG, TURNS

LOSSLESS = {"policy": "none", "codec": "none"}


def _compressing_in_the_child(make_service, worker):
    return make_service(tiers=("dram",), worker=worker, compression=KVZIP_INT4, compress_after_seconds=0,
                        compress_process=True)


async def _stored_and_compressed(service) -> str:
    """A conversation's first turn, stored, then compressed (in the child process)."""
    session = (await service.create(None, None)).id
    await _turn(service, session, LONG)
    await service.offload(session)
    await service.compress_due()
    return session


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


def test_the_child_compresses_without_model_thread_work_and_restores_like_the_model_thread(make_service, tmp_path):
    child = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0, compress_process=True,
                         data_dir=tmp_path / "child")
    here = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0, compress_quiet_seconds=0,
                        data_dir=tmp_path / "here")

    async def compressed_reply(service):
        session = (await service.create(None, None)).id
        await _turn(service, session, LONG)
        exact = await service.offload(session)
        await service.compress_due()
        view = await service.view(session)
        assert view.is_compressed and view.codec == "int4-rot-g32-s1"
        assert view.stored_bytes < 0.2 * exact.stored_bytes
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "dram"
        return result.content

    async def scenario():
        assert await compressed_reply(child) == await compressed_reply(here)
        report = child.stats()
        assert report["compression"]["compressed"] == 1 and report["compression"]["process_jobs"] == 1
        assert report["compression"]["process_cpu_seconds"] > 0
        assert report["model_thread"]["background_seconds"] == 0  # scoring ran in the child
        assert here.stats()["model_thread"]["background_seconds"] > 0
        # The placement policy weighs compressing by what these measured: the child's CPU, both ratios.
        for service, timed in ((child, 1), (here, 0)):
            compression, weighed = service.stats()["compression"], service.stats()["placement"]["compression"]
            assert (weighed["compressions_seen"], weighed["compressions_timed"]) == (1, timed)
            measured = compression["raw_bytes"] / compression["stored_bytes"]
            assert min(8.0, measured) <= weighed["compression_ratio"] <= max(8.0, measured)

    asyncio.run(scenario())


def test_a_turn_during_a_child_compression_cancels_it_and_reads_the_exact_blob(make_service):
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0, compress_process=True)

    async def scenario():
        warm = (await service.create(None, None)).id  # starts the child and loads its model
        await _turn(service, warm, TURNS[0])
        await service.offload(warm)
        await service.compress_due()
        session = (await service.create(None, None)).id
        twin = (await service.create(None, None, LOSSLESS)).id
        for name in (session, twin):
            await _turn(service, name, LONG)
        await service.offload(session)
        compression = asyncio.create_task(service.compress_due())
        while not service.compactor.process.busy:
            await asyncio.sleep(0.002)
        started = time.monotonic()
        restored = await _turn(service, session, TURNS[1])
        elapsed = time.monotonic() - started
        await compression
        counters = service.compactor.counters
        assert (counters.cancelled, counters.compressed) == (1, 1)  # the warm-up's only
        assert restored.restore_source == "dram"
        started = time.monotonic()
        assert restored.content == (await _turn(service, twin, TURNS[1])).content
        assert elapsed < 3 * (time.monotonic() - started) + 0.2  # about a hot turn: nothing to wait for
        view = await service.offload(session)
        assert view.is_compressed is False and service.compactor.report()["queued"] == 1

    asyncio.run(scenario())


def test_the_child_keeps_the_kv_dtype_the_start_up_measurement_chose(make_service, tiny_model_dir):
    """KV_DTYPE=auto is decided by timing at start (statekeeper/kv_dtype_choice.py) and can differ from what the
    setting's rule alone gives; the child must keep the KV dtype the parent chose, or its fingerprint differs
    and every compression fails (as on an AMD EPYC, where the measurement keeps float32)."""
    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64,
                          kv_dtype="auto")
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    assert worker.kv_dtype == torch.float32  # the rule for a model that is not the bundled one
    worker.use_kv_dtype(torch.bfloat16)  # what kv_dtype_choice.choose applies when bfloat16 measures faster
    service = _compressing_in_the_child(make_service, worker)

    async def scenario():
        session = await _stored_and_compressed(service)
        counters = service.compactor.counters
        assert (counters.compressed, counters.failed) == (1, 0)
        assert (await _turn(service, session, TURNS[1])).restore_source == "dram"

    asyncio.run(scenario())


def test_a_base_model_served_with_a_chat_template_file_compresses_in_the_child(make_service, base_model_dir):
    """CHAT_TEMPLATE serves a base model; the child process is handed the worker's settings as JSON, which could
    not hold the template file's path: with COMPRESS_PROCESS on (the default) the service did not start."""
    base, template = base_model_dir
    config = WorkerConfig(model=str(base), model_cache_dir=MODEL_CACHE, chat_template=template)
    service = _compressing_in_the_child(make_service, ModelWorker(load_model(config.model, config.model_cache_dir),
                                                                  config))

    async def scenario():
        session = await _stored_and_compressed(service)
        assert (await service.view(session)).is_compressed
        assert service.stats()["compression"]["process_jobs"] == 1

    asyncio.run(scenario())
