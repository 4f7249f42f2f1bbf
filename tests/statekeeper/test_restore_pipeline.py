import dataclasses
import threading

import pytest
import torch

from scheduler.plan import RestorePlan
from statekeeper.compression import StoredForm
from statekeeper.restore_pipeline import RestoreCancelled, restore_pipelined

from tests.statekeeper.restore_cases import MESSAGE, TOKENS, compressed, sequential


@pytest.fixture(scope="module")
def stored(tiny_worker):
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, TOKENS)
    return [(k.clone(), v.clone()) for k, v in cache.export_layers()]


def _greedy(worker, cache, steps=8):
    logits, out = worker.prefill(cache, [7, 8, 9]), []
    for _ in range(steps):
        token = int(logits.argmax())
        out.append(token)
        logits = worker.decode(cache, token)
    return out


def _plan(r, n=len(TOKENS)):
    return RestorePlan(n, r, 1.0, 1.0)


@pytest.mark.parametrize("recompute", [0, 1, 63, 64, 100, 199, 200])
def test_every_split_restores_the_same_state_as_full_recompute(tiny_worker, stored, recompute):
    cache, report = restore_pipelined(tiny_worker, stored, TOKENS, _plan(recompute))
    assert cache.num_tokens == len(TOKENS) and report.fallback is None
    for (k, v), (k2, v2) in zip(stored, cache.export_layers()):
        assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
        assert torch.equal(k[:, recompute:], k2[:, recompute:])  # the loaded rows are the stored bytes
    full = tiny_worker.new_cache()
    tiny_worker.prefill(full, TOKENS)
    assert _greedy(tiny_worker, cache) == _greedy(tiny_worker, full)
    loaded = [t.load for t in report.layers]
    computed = [t.compute for t in report.layers]
    assert all(t is not None for t in loaded) == (recompute < len(TOKENS))
    assert all(t is not None for t in computed) == (recompute > 0)
    assert set(report.summary()) >= {"planned", "measured", "bubble_fraction", "recompute_tokens"}


def test_a_load_fault_mid_restore_recomputes_and_still_gives_the_right_state(tiny_worker, stored):
    broken = list(stored)
    k, v = broken[2]
    broken[2] = (k[:, :10], v[:, :10])  # the blob ends early for this layer: the copy fails
    cache, report = restore_pipelined(tiny_worker, broken, TOKENS, _plan(50))
    assert report.fallback and "holds 10 of 200" in report.fallback
    for (k, v), (k2, v2) in zip(stored, cache.export_layers()):
        assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)


def test_a_late_load_is_abandoned_and_recomputed(tiny_worker, stored):
    cache, report = restore_pipelined(tiny_worker, stored, TOKENS, _plan(20), throttle_mb_per_s=0.05,
                                      load_timeout_s=0.01)
    assert "late" in report.fallback or "still running" in report.fallback
    assert cache.num_tokens == len(TOKENS)
    assert torch.allclose(stored[-1][0], cache.export_layers()[-1][0], atol=1e-5)


def test_a_recompute_that_fails_stops_its_loader_before_raising(tiny_worker, stored, monkeypatch):
    """The recompute raised (out of memory, a forward that cannot run) and left the loader copying out of the
    blob's views after the caller had closed the tier read they point into (an LMDB map can then move)."""
    def failing_prefill(*args, **kwargs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(tiny_worker, "prefill", failing_prefill)
    with pytest.raises(RuntimeError, match="the forward failed"):
        restore_pipelined(tiny_worker, stored, TOKENS, _plan(50), throttle_mb_per_s=0.05)
    assert not [thread for thread in threading.enumerate() if thread.name == "statekeeper-restore-loader"]


def test_a_cancelled_restore_stops_both_sides(tiny_worker, stored):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RestoreCancelled):
        restore_pipelined(tiny_worker, stored, TOKENS, _plan(20), cancel=cancel)


# -- a compressed blob, layer by layer behind the new message's prefill --------------------------------



_compressed, _sequential = compressed, sequential


def _no_hooks_left(worker) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in worker.decoder_layers())


@pytest.fixture(scope="module")
def bf16_worker(tiny_model_dir, tiny_worker):
    """The tiny model with its KV cache in bfloat16 (WorkerConfig.kv_dtype)."""
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=tiny_worker.config.model_cache_dir,
                          prefill_chunk_tokens=64, kv_dtype="bfloat16")
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


@pytest.mark.parametrize("recompute", [0, 64, 100, 200])
def test_a_bfloat16_cache_restores_pipelined_to_the_state_it_stored(bf16_worker, recompute):
    original = bf16_worker.new_cache()
    bf16_worker.prefill(original, TOKENS)
    stored = [(k.clone(), v.clone()) for k, v in original.export_layers()]
    cache, report = restore_pipelined(bf16_worker, stored, TOKENS, _plan(recompute))
    assert cache.num_tokens == len(TOKENS) and report.fallback is None
    for (k, v), (k2, v2) in zip(stored, cache.export_layers()):
        assert k2.dtype == v2.dtype == torch.bfloat16
        assert torch.equal(k[:, recompute:], k2[:, recompute:])  # the loaded rows are the stored bytes
        # recomputed rows: the same forward in other chunks rounds the last bit kept differently at most
        assert torch.allclose(k.float(), k2.float(), atol=0.05, rtol=2 ** -6)
    assert _greedy(bf16_worker, cache) == _greedy(bf16_worker, original)


@pytest.mark.parametrize("method", ["expected@0.5+int4-rot-g32-s1", "expected-merge@0.5", "expected@0.3+int8"])
@pytest.mark.parametrize("worker_name", ["tiny_worker", "bf16_worker"])
def test_a_compressed_blob_restored_layer_by_layer_equals_restoring_it_first(request, worker_name, method):
    from statekeeper.restore_pipeline import restore_compressed_layerwise

    tiny_worker = request.getfixturevalue(worker_name)

    tensors, form = _compressed(tiny_worker, method)
    expected_cache, expected_logits = _sequential(tiny_worker, tensors, form)
    cache, logits, report = restore_compressed_layerwise(tiny_worker, tensors, form, TOKENS + MESSAGE)
    assert report.fallback is None and cache.num_tokens == len(TOKENS) + len(MESSAGE)
    assert torch.allclose(logits, expected_logits, atol=1e-5, rtol=1e-5)
    for (k, v), (k2, v2) in zip(expected_cache.export_layers(), cache.export_layers()):
        assert torch.equal(k[:, : len(TOKENS)], k2[:, : len(TOKENS)])  # the restored rows, bit for bit
        assert k2.dtype == tiny_worker.kv_dtype
        assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(expected_cache.head_bias, cache.head_bias))
    assert _greedy(tiny_worker, cache, 4) == _greedy(tiny_worker, expected_cache, 4)
    assert all(t.load is not None and t.compute is not None for t in report.layers)
    assert _no_hooks_left(tiny_worker)


def test_the_prefill_waits_for_each_layer_of_a_slow_load(tiny_worker, monkeypatch):
    import time

    from statekeeper.compression import head_budget
    from statekeeper.restore_pipeline import restore_compressed_layerwise

    tensors, form = _compressed(tiny_worker, "expected@0.5+int4-rot-g32-s1")
    expected_logits = _sequential(tiny_worker, tensors, form)[1]
    scatter = head_budget.scatter_layer

    def slow_scatter(*args):
        time.sleep(0.05)
        scatter(*args)

    monkeypatch.setattr(head_budget, "scatter_layer", slow_scatter)
    cache, logits, report = restore_compressed_layerwise(tiny_worker, tensors, form, TOKENS + MESSAGE)
    assert report.fallback is None and torch.allclose(logits, expected_logits, atol=1e-5, rtol=1e-5)
    assert report.wait_ms >= 0.05 * 1e3 * (tiny_worker.num_layers - 1)
    assert all(t.compute[0] >= t.load[1] for t in report.layers)  # no layer ran before its rows were written


def test_a_layer_that_does_not_fit_recomputes_everything(tiny_worker):
    from statekeeper.restore_pipeline import restore_compressed_layerwise

    from tests.utils.compression import with_index_positions

    tensors, form = _compressed(tiny_worker, "expected@0.5+int4-rot-g32-s1")
    broken = with_index_positions(tensors)  # as blobs were written before the kept bits
    broken["2.index"] = broken["2.index"].clone()
    broken["2.index"][:3] = -1  # layer 2's positions do not fit (the bias alone does not notice)
    cache, logits, report = restore_compressed_layerwise(tiny_worker, broken, form, TOKENS + MESSAGE)
    assert report.fallback and "layer 2" in report.fallback
    full = tiny_worker.new_cache()
    assert torch.allclose(logits, tiny_worker.prefill(full, TOKENS + MESSAGE), atol=1e-5)
    assert cache.head_bias is None and cache.num_tokens == len(TOKENS) + len(MESSAGE)
    assert _no_hooks_left(tiny_worker)


def test_a_late_layer_is_abandoned_and_recomputed(tiny_worker, monkeypatch):
    import time

    from statekeeper.compression import head_budget
    from statekeeper.restore_pipeline import restore_compressed_layerwise

    tensors, form = _compressed(tiny_worker, "expected@0.5")
    monkeypatch.setattr(head_budget, "scatter_layer", lambda *args: time.sleep(0.5))
    cache, _, report = restore_compressed_layerwise(tiny_worker, tensors, form, TOKENS + MESSAGE,
                                                    load_timeout_s=0.05)
    assert "not loaded within" in report.fallback and cache.head_bias is None
    assert _no_hooks_left(tiny_worker)


def test_a_cancelled_layerwise_restore_stops_and_layouts_it_cannot_split_are_refused(tiny_worker):
    from statekeeper.restore_pipeline import restore_compressed_layerwise

    tensors, form = _compressed(tiny_worker, "expected@0.5")
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RestoreCancelled):
        restore_compressed_layerwise(tiny_worker, tensors, form, TOKENS + MESSAGE, cancel=cancel)
    assert _no_hooks_left(tiny_worker)
    with pytest.raises(ValueError):
        restore_compressed_layerwise(tiny_worker, tensors, dataclasses.replace(
            form, kind="shared_heads", pairs=((0, 1),), parts=("v",)), TOKENS + MESSAGE)
    with pytest.raises(ValueError):
        restore_compressed_layerwise(tiny_worker, tensors, form, TOKENS)  # nothing to prefill
