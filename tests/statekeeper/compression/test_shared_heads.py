import pytest
import torch

from statekeeper.compression import SharedHeadEviction, by_name, restore_state
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.sharing import CrossLayerSharing
from tests.statekeeper.compression.test_head_budget import LAYERS, _state


def _method(merge=False, share_keys=False):
    sharing = CrossLayerSharing("pair", "fixed", pairs=[(0, 1)], share_keys=share_keys)
    return SharedHeadEviction("pair/expected", sharing, HeadBudgetEviction("e", "expected", keep=0.4, merge=merge))


def _parallel_values(layers):
    """Layer 1's values point where layer 0's do (a pair SLERP merges without loss)."""
    layers[1] = (layers[1][0], 3 * layers[0][1])
    return layers


def test_a_pair_keeps_one_token_set_and_unpaired_layers_evict_as_alone():
    layers, stats = _state()
    shared = _method().compress(layers, stats)
    alone = HeadBudgetEviction("e", "expected", keep=0.4).compress(layers, stats)
    assert torch.equal(torch.isfinite(shared.head_bias[0]), torch.isfinite(shared.head_bias[1]))
    assert not torch.equal(torch.isfinite(alone.head_bias[0]), torch.isfinite(alone.head_bias[1]))
    assert torch.equal(shared.head_bias[2], alone.head_bias[2])
    counts = [int(torch.isfinite(b).sum()) for b in shared.head_bias]
    assert counts[0] == counts[2]  # the pair's set is chosen with one layer's budget


def test_the_pair_stores_one_direction_per_kept_row_and_its_positions_once():
    layers, stats = _state()
    shared = _method().compress(layers, stats)
    names = {name for name, _ in shared.tensors}
    assert {"0+1.v.direction", "0+1.v.norm_a", "0.k", "1.k", "0.kept", "2.v"} <= names
    assert not names & {"0.v", "1.v", "1.index", "1.kept", "1.counts"}
    alone = HeadBudgetEviction("e", "expected", keep=0.4).compress(layers, stats)
    value_row = layers[0][1][0, 0].nbytes
    kept = int(torch.isfinite(shared.head_bias[0]).sum())
    assert shared.stored_bytes < alone.stored_bytes
    assert shared.stored_bytes == sum(t.nbytes for _, t in shared.tensors)
    assert alone.stored_bytes - shared.stored_bytes < kept * value_row  # at most one row per kept entry saved


@pytest.mark.parametrize("merge", [False, True])
def test_restore_rebuilds_the_attended_layers(merge):
    layers, stats = _state()
    layers = _parallel_values(layers)
    shared = _method(merge=merge).compress(layers, stats)
    back, bias = restore_state(dict(shared.tensors), shared.meta, LAYERS)
    for (k, v), (k2, v2), b, b2 in zip(shared.layers, back, shared.head_bias, bias):
        assert torch.equal(b, b2) and torch.equal(k, k2) and torch.equal(v, v2)
    kept = torch.isfinite(bias[1])
    if not merge:
        assert torch.allclose(back[1][1][kept], layers[1][1][kept], atol=1e-4)  # parallel rows merge exactly
        assert torch.equal(back[1][0][kept], layers[1][0][kept])  # keys are not shared: stored as they are


def test_a_codec_applies_after_sharing_and_eviction():
    layers, stats = _state()
    method = by_name("damage/expected@0.4+int4", rankings={"v": [(0, 1)]}, ratio=0.7)
    compressed = method.compress(layers, stats)
    assert compressed.form.pairs == ((0, 1),) and compressed.form.codec
    back, bias = restore_state(dict(compressed.tensors), compressed.meta, LAYERS)
    for (k, v), (k2, v2), b in zip(compressed.layers, back, bias):
        assert torch.equal(k, k2) and torch.equal(v, v2)
        assert torch.isfinite(b).any()
    plain = by_name("expected@0.4+int4").compress(layers, stats)
    assert compressed.stored_bytes < plain.stored_bytes


@pytest.mark.parametrize("name", ["kvzip@0.5/damage", "krul/none", "damage/kvzip-bogus@0.5"])
def test_a_composition_needs_sharing_then_a_per_head_method(name):
    with pytest.raises(ValueError):
        by_name(name, rankings={"v": [(0, 1)]})
