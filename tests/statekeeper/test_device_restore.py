"""The GPU restore's code on a CPU worker: no streams, no ring, copies in order. The same code the GPU suite
(tests/gpu/) runs on a device must give exactly what a state that never left memory gives."""

import pytest
import torch

from statekeeper.device_restore import DeviceRestorer
from tests.statekeeper.restore_cases import MESSAGE, TOKENS, compressed, sequential


@pytest.fixture(scope="module")
def stored(tiny_worker):
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, TOKENS)
    return [(k.clone(), v.clone()) for k, v in cache.export_layers()]


def _hot(worker):
    cache = worker.new_cache()
    worker.prefill(cache, TOKENS)
    return cache, worker.prefill(cache, MESSAGE)


def _no_hooks_left(worker) -> bool:
    return all(not m._forward_pre_hooks and not m._forward_hooks for m in worker.decoder_layers())


def test_an_exact_restore_with_nothing_recomputed_equals_the_hot_state_bit_for_bit(tiny_worker, stored):
    hot, hot_logits = _hot(tiny_worker)
    cache, logits, report = DeviceRestorer(tiny_worker).restore_exact(stored, TOKENS, MESSAGE)
    assert torch.equal(logits, hot_logits)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(hot.export_layers(), cache.export_layers()))
    assert report.copied_bytes == sum(k.nbytes + v.nbytes for k, v in stored) and report.fallback is None
    assert _no_hooks_left(tiny_worker)


@pytest.mark.parametrize("recompute", [1, 63, 64, 100, 199, 200])
def test_every_split_restores_what_the_hot_state_holds(tiny_worker, stored, recompute):
    hot, hot_logits = _hot(tiny_worker)
    cache, logits, report = DeviceRestorer(tiny_worker).restore_exact(stored, TOKENS, MESSAGE, recompute)
    assert report.recompute_tokens == recompute and cache.num_tokens == len(TOKENS) + len(MESSAGE)
    for (k, v), (k2, v2) in zip(hot.export_layers(), cache.export_layers()):
        assert torch.equal(k[:, recompute: len(TOKENS)], k2[:, recompute: len(TOKENS)])  # the copied rows
        # recomputed rows: the same float32 forward in other chunks differs by reduction order only
        assert torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)
    assert torch.allclose(logits, hot_logits, atol=1e-5, rtol=1e-5)


def test_a_restore_needs_stored_rows_for_the_whole_history(tiny_worker, stored):
    short = [(k[:, :100], v[:, :100]) for k, v in stored]
    with pytest.raises(ValueError, match="cover"):
        DeviceRestorer(tiny_worker).restore_exact(short, TOKENS, MESSAGE)
    with pytest.raises(ValueError):
        DeviceRestorer(tiny_worker).restore_exact(stored, TOKENS, MESSAGE, len(TOKENS) + 1)


@pytest.mark.parametrize("groups", [1, 2, 4])  # layers decoded together: all four, two by two, one by one
@pytest.mark.parametrize("method", ["expected@0.5+int4-rot-g32-s1", "expected-merge@0.5", "expected@0.3+int8",
                                    "expected@0.5+int4-pk10", "expected@0.5", "expected@0.5+int4-kc",
                                    "expected-global@0.5+int4-v3-rot-sym-pk8-s1", "expected@0.05+int4-v2-pk30"])
def test_a_compressed_restore_equals_restoring_the_blob_first(tiny_worker, method, groups):
    tensors, form = compressed(tiny_worker, method)
    expected, expected_logits = sequential(tiny_worker, tensors, form)
    restorer = DeviceRestorer(tiny_worker, compressed_groups=groups)
    cache, logits, report = restorer.restore_compressed(tensors, form, TOKENS, MESSAGE)
    assert report.fallback is None and report.compressed
    assert torch.equal(logits, expected_logits)
    for (k, v), (k2, v2) in zip(expected.export_layers(), cache.export_layers()):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert all(torch.equal(a, b) for a, b in zip(expected.head_bias, cache.head_bias))
    assert _no_hooks_left(tiny_worker)


def test_a_compressed_blob_that_does_not_fit_recomputes_from_the_history(tiny_worker):
    tensors, form = compressed(tiny_worker, "expected@0.5+int4")
    forged = dict(tensors) | {"1.counts": tensors["1.counts"] + 1}  # rows that the kept bits do not hold
    _, hot_logits = _hot(tiny_worker)
    cache, logits, report = DeviceRestorer(tiny_worker).restore_compressed(forged, form, TOKENS, MESSAGE)
    assert report.fallback is not None and cache.head_bias is None
    assert torch.equal(logits, tiny_worker.prefill(tiny_worker.new_cache(), TOKENS + MESSAGE))
    assert torch.allclose(logits, hot_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 4])
def test_sparse_bookkeeping_restores_too(tiny_worker, groups):
    """Few kept entries: row numbers instead of kept bits, and the 8-bit rows by number instead of a mask."""
    tokens = [5 + i % 290 for i in range(800)]  # the tiny vocabulary, 800 tokens
    tensors, form = compressed(tiny_worker, "expected@0.01+int4-pk5", tokens)
    assert "0.index" in tensors and "0.k.precise_rows" in tensors
    expected, expected_logits = sequential(tiny_worker, tensors, form)
    cache, logits, report = DeviceRestorer(tiny_worker, compressed_groups=groups).restore_compressed(
        tensors, form, tokens, MESSAGE)
    assert report.fallback is None and torch.equal(logits, expected_logits)
    assert all(torch.equal(a, b) for a, b in zip(expected.head_bias, cache.head_bias))


@pytest.mark.parametrize("forge", ["a kept bit past the history", "a head's count", "an 8-bit row mark", "a layer's rows",
                                   "an exact row twice", "an 8-bit mark moved past the rows", "an exact row past the rows"])
def test_the_host_checks_refuse_a_forged_blob_before_anything_is_copied(tiny_worker, forge):
    from kernels.quant import pack_mask, unpack_mask
    from statekeeper.compression import restore_state
    from statekeeper.compression.layer_decode import check_layer, check_layers

    history = list(range(5, 210))  # 205 tokens: kept bits padded to 208
    tensors, form = compressed(tiny_worker, "expected-global@0.5+int4-v3-rot-sym-pk8-s1", history)
    layers, heads = tiny_worker.num_layers, tiny_worker.num_kv_heads
    assert check_layers(tensors, form, layers, heads) == [check_layer(tensors, form, i, heads) for i in range(layers)]
    forged = dict(tensors)
    if forge == "a kept bit past the history":
        bits = unpack_mask(tensors["2.kept"]).clone()
        bits[0, len(history)] = True
        forged["2.kept"] = pack_mask(bits)
    elif forge == "a head's count":
        forged["0.counts"] = tensors["0.counts"].flip(0) + torch.tensor([1, -1])
    elif forge == "an 8-bit row mark":
        bits = unpack_mask(tensors["1.k.precise_mask"]).clone()
        bits[bits.nonzero()[0, 0]] = False  # one 8-bit row fewer than the description says
        forged["1.k.precise_mask"] = pack_mask(bits)
    elif forge == "an exact row twice":
        rows = tensors["1.v.exact_rows"].clone()
        assert len(rows) == 2  # the sink's row in each head
        rows[1] = rows[0]  # the other head's sink row would stay as decoded, quietly
        forged["1.v.exact_rows"] = rows
    elif forge == "an 8-bit mark moved past the rows":  # as many marks as described, one in the padding
        rows = check_layer(tensors, form, 2, heads).rows
        bits = unpack_mask(tensors["2.k.precise_mask"]).clone()
        assert len(bits) > rows  # padded to whole bytes
        bits[bits.nonzero()[0, 0]], bits[rows] = False, True
        forged["2.k.precise_mask"] = pack_mask(bits)
    elif forge == "an exact row past the rows":
        rows = tensors["1.k.exact_rows"].clone()
        rows[0] = check_layer(tensors, form, 1, heads).rows
        forged["1.k.exact_rows"] = rows
    else:
        forged["3.counts"] = tensors["3.counts"] + 1
    with pytest.raises(ValueError):
        check_layers(forged, form, layers, heads)
    with pytest.raises((ValueError, RuntimeError)):  # the CPU restore refuses it too (its documented errors)
        restore_state(forged, form, layers)
    _, logits, report = DeviceRestorer(tiny_worker).restore_compressed(forged, form, history, MESSAGE)
    assert report.fallback is not None
    assert torch.equal(logits, tiny_worker.prefill(tiny_worker.new_cache(), history + MESSAGE))
