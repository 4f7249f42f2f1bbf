"""TORCH_THREADS is the model thread's alone (issue 17): every other thread that touches torch runs with one.
OpenMP keeps a team of threads per thread that ran a parallel region at more than one, for as long as that
thread lives; two teams on two cores made every decode step 2x slower (benchmarks/thread_placement.py)."""

import asyncio
import threading

import torch

from statekeeper.config import WorkerConfig
from statekeeper.settings import load_settings
from statekeeper.assembly import build_service
from tests.conftest import MODEL_CACHE


def _in_new_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_only_the_model_thread_runs_with_torch_threads(monkeypatch, tmp_path, tiny_model_dir):
    monkeypatch.setenv("STATEKEEPER_TORCH_THREADS", "2")
    monkeypatch.setenv("STATEKEEPER_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("STATEKEEPER_MODEL_CACHE_DIR", str(MODEL_CACHE))
    config = load_settings(data_dir=str(tmp_path)).to_config()
    assert config.worker.num_threads == 2
    service = build_service(config)  # loads the model and measures the restore profile: at 2, not on this thread
    try:
        assert service.worker.config.num_threads == 2  # the hardware profile is keyed by the model thread's count

        async def counts():
            return await asyncio.gather(service.executors.in_model_thread(torch.get_num_threads),
                                        service.in_io_thread(torch.get_num_threads),
                                        service.executors.in_restore_thread(torch.get_num_threads))

        assert asyncio.run(counts()) == [2, 1, 1]
        assert torch.get_num_threads() == 1  # the event loop's thread
        assert _in_new_thread(torch.get_num_threads) == 1  # threads born later: the API's thread pool, asyncio's
    finally:
        service.close()


def test_a_worker_built_on_a_thread_runs_there_with_its_threads(tiny_model_dir):
    """Benchmarks and the evaluation tools call the worker on the thread that built it."""
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    def build_and_count():
        config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, num_threads=2)
        ModelWorker(load_model(config.model, config.model_cache_dir), config)
        return torch.get_num_threads()

    assert _in_new_thread(build_and_count) == 2
