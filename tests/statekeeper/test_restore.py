import threading

import pytest
import torch

from scheduler.plan import RestorePlan
from statekeeper.restore import RestoreCancelled, restore_pipelined

TOKENS = list(range(5, 205))


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


def test_a_cancelled_restore_stops_both_sides(tiny_worker, stored):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RestoreCancelled):
        restore_pipelined(tiny_worker, stored, TOKENS, _plan(20), cancel=cancel)
