"""KV_DTYPE=auto chooses by what was measured on this machine (statekeeper/kv_dtype_choice.py); an explicit
KV_DTYPE is honoured."""

import json

import pytest
import torch

from statekeeper.config import WorkerConfig
from statekeeper.kv_dtype_choice import DtypeTiming, choose, fastest, timings_path
from statekeeper.machine import machine_id
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE


@pytest.fixture(scope="module")
def smollm2():
    """A SmolLM2 worker of this module's own: the choice changes its KV dtype."""
    config = WorkerConfig(model="smollm2", model_cache_dir=MODEL_CACHE)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


def fake_profile(directory, worker, cpu: str, float32_ms: float, bfloat16_ms: float) -> None:
    """Timings as if measured: `*_ms` a token, alone and in a batch alike."""
    timings = [{"dtype": "float32", "decode_ms": float32_ms, "batched_ms": float32_ms * 4},
               {"dtype": "bfloat16", "decode_ms": bfloat16_ms, "batched_ms": bfloat16_ms * 4}]
    path = timings_path(directory, worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu, "timings": timings}))


def test_the_fastest_is_the_least_time_a_token_alone_and_batched():
    slow_alone = DtypeTiming("bfloat16", decode_ms=30.0, batched_ms=40.0)  # (30 + 10) / 2 = 20
    slow_batched = DtypeTiming("float32", decode_ms=20.0, batched_ms=100.0)  # (20 + 25) / 2 = 22.5
    assert fastest([slow_batched, slow_alone]) is slow_alone
    assert fastest([slow_alone, DtypeTiming("float32", 10.0, 40.0)]).dtype == "float32"


@pytest.mark.parametrize(("float32_ms", "bfloat16_ms", "expected"),
                         [(20.0, 30.0, torch.float32), (30.0, 20.0, torch.bfloat16)])
def test_auto_takes_the_dtype_the_profile_measured_faster(smollm2, tmp_path, float32_ms, bfloat16_ms, expected):
    fake_profile(tmp_path, smollm2, machine_id(), float32_ms, bfloat16_ms)
    choice = choose(smollm2, tmp_path, "auto")
    assert smollm2.kv_dtype == expected and choice.dtype == str(expected).removeprefix("torch.")
    assert smollm2.new_cache().layers[0].buffer_dtype == expected
    # stored KV names the dtype it was kept in: a blob of the other dtype is not this worker's
    assert (smollm2.fingerprint == smollm2.model_fingerprint) == (expected == torch.float32)
    assert "measured fastest" in choice.reason and len(choice.timings) == 2


def test_an_explicit_kv_dtype_is_honoured(smollm2, tmp_path):
    smollm2.use_kv_dtype(torch.float32)
    fake_profile(tmp_path, smollm2, machine_id(), float32_ms=30.0, bfloat16_ms=10.0)
    choice = choose(smollm2, tmp_path, "float32")
    assert choice.dtype == "float32" and choice.reason == "set by KV_DTYPE" and not choice.timings
    assert smollm2.kv_dtype == torch.float32


def test_timings_from_another_cpu_are_measured_again(smollm2, tmp_path):
    fake_profile(tmp_path, smollm2, "Some Other CPU", float32_ms=1.0, bfloat16_ms=1000.0)
    choice = choose(smollm2, tmp_path, "auto")
    saved = json.loads(timings_path(tmp_path, smollm2).read_text())
    assert saved["cpu"] == machine_id() == choice.cpu
    assert sorted(t["dtype"] for t in saved["timings"]) == ["bfloat16", "float32"]
    assert all(t["decode_ms"] > 0 and t["batched_ms"] > 0 for t in saved["timings"])
    assert choice.dtype == fastest(choice.timings).dtype and smollm2.kv_dtype == getattr(torch, choice.dtype)
    assert 1000.0 not in [t.decode_ms for t in choice.timings]


def test_a_model_with_one_candidate_keeps_its_own_dtype_unmeasured(tiny_worker, tmp_path):
    choice = choose(tiny_worker, tmp_path, "auto")
    assert choice.dtype == str(tiny_worker.dtype).removeprefix("torch.") and not choice.timings
    assert not list(tmp_path.iterdir())
