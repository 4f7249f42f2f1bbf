import math

import pytest
import torch

from statekeeper.compression import by_name, restore_state
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.head_budget import HeadBudgetEviction

HEADS, TOKENS, DIM, LAYERS = 2, 100, 16, 3


def _state(seed=0):
    torch.manual_seed(seed)
    layers = [(torch.randn(HEADS, TOKENS, DIM), torch.randn(HEADS, TOKENS, DIM)) for _ in range(LAYERS)]
    stats = AttentionStats(LAYERS)
    stats.recent_queries = [torch.randn(2 * HEADS, 8, DIM).half() for _ in range(LAYERS)]
    return layers, stats


@pytest.mark.parametrize("scorer", ["expected", "snapkv"])
def test_uniform_budgets_keep_the_same_count_per_head_with_sinks_and_recent_tokens(scorer):
    layers, stats = _state()
    method = HeadBudgetEviction("h", scorer, keep=0.4, budgets="uniform", sink_tokens=4, recent_tokens=8)
    compressed = method.compress(layers, stats)
    for bias in compressed.head_bias:
        kept = torch.isfinite(bias)
        assert kept.sum(1).tolist() == [40, 40]
        assert kept[:, :4].all() and kept[:, -8:].all()
    full = sum(k.nbytes + v.nbytes for k, v in layers)
    assert 0.4 * full < compressed.stored_bytes < 0.45 * full  # plus 2-byte positions and counts


def test_adaptive_budgets_share_a_layer_budget_unevenly():
    layers, stats = _state()
    stats.recent_queries = [torch.randn(2 * HEADS, 8, DIM).half() for _ in range(LAYERS)]
    stats.recent_queries[0][:2] *= 6  # head 0's queries are peaked: few tokens matter to it
    compressed = HeadBudgetEviction("h", "expected", keep=0.3, sink_tokens=2, recent_tokens=4).compress(layers, stats)
    counts = torch.isfinite(compressed.head_bias[0]).sum(1)
    assert int(counts.sum()) == math.ceil(0.3 * TOKENS * HEADS) and counts[0] != counts[1]


def test_restore_gives_kept_rows_exactly_and_hides_the_rest():
    layers, stats = _state()
    compressed = HeadBudgetEviction("h", "expected", keep=0.5).compress(layers, stats)
    layers_back, bias = restore_state(dict(compressed.tensors), compressed.meta, LAYERS)
    for (k, v), (k2, v2), b, b2 in zip(layers, layers_back, bias, compressed.head_bias):
        assert torch.equal(b, b2)
        kept = torch.isfinite(b)
        assert torch.equal(k[kept], k2[kept]) and torch.equal(v[kept], v2[kept])
        assert not k2[~kept].any()


def test_recompressing_a_restored_state_never_revives_evicted_entries_and_keeps_votes():
    layers, stats = _state()
    first = HeadBudgetEviction("h", "expected", keep=0.5, merge=True).compress(layers, stats)
    assert any(bool((b > 0).any()) for b in first.head_bias)  # some carriers hold merged votes
    total_votes = [float(torch.where(torch.isfinite(b), b.exp(), 0).sum()) for b in first.head_bias]
    assert total_votes == [HEADS * TOKENS] * LAYERS  # every evicted token merged (none is recent)
    second = HeadBudgetEviction("h", "expected", keep=0.3, merge=True).compress(first.layers, stats, first.head_bias)
    for before, after in zip(first.head_bias, second.head_bias):
        assert not (torch.isfinite(after) & ~torch.isfinite(before)).any()
        assert float(torch.where(torch.isfinite(after), after.exp(), 0).sum()) == pytest.approx(HEADS * TOKENS)


def test_codec_on_top_of_per_head_eviction_round_trips():
    layers, stats = _state()
    compressed = by_name("expected@0.5+int8").compress(layers, stats)
    plain = by_name("expected@0.5").compress(layers, stats)
    assert compressed.stored_bytes < 0.35 * plain.stored_bytes
    layers_back, bias = restore_state(dict(compressed.tensors), compressed.meta, LAYERS)
    assert all(torch.equal(a, b) for a, b in zip(bias, plain.head_bias))
    assert torch.allclose(layers_back[0][0], plain.layers[0][0], atol=0.05)


def test_without_recent_queries_or_with_a_foreign_bias_methods_refuse():
    layers, _ = _state()
    with pytest.raises(ValueError, match="recent queries"):
        HeadBudgetEviction("h").compress(layers, AttentionStats(LAYERS))
    with pytest.raises(ValueError, match="bias"):
        by_name("minicache").compress(layers, None, [torch.zeros(HEADS, TOKENS)] * LAYERS)


def test_a_blob_whose_positions_do_not_fit_is_refused():
    from tests.utils.compression import with_index_positions

    layers, stats = _state()
    compressed = HeadBudgetEviction("h", "snapkv", keep=0.5).compress(layers, stats)
    tensors = with_index_positions(dict(compressed.tensors))  # as blobs were written before the kept bits
    tensors["0.index"] = tensors["0.index"].clone()
    tensors["0.index"][0] = TOKENS + 5
    with pytest.raises(ValueError, match="do not fit"):
        restore_state(tensors, compressed.meta, LAYERS)
    bits = dict(compressed.tensors)
    bits["0.kept"] = bits["0.kept"].clone()
    bits["0.kept"][0, 0] ^= 0b10  # one position more than the head's count
    with pytest.raises(ValueError, match="do not match"):
        restore_state(bits, compressed.meta, LAYERS)


@pytest.mark.parametrize("keep, layout", [(0.5, "kept"), (0.04, "index")])
def test_positions_are_stored_as_bits_or_numbers_whichever_is_smaller(keep, layout):
    from tests.utils.compression import with_index_positions

    layers, stats = _state()
    eviction = HeadBudgetEviction("h", "snapkv", keep=keep, sink_tokens=1, recent_tokens=1)
    compressed = eviction.compress(layers, stats)
    tensors = dict(compressed.tensors)
    other = "index" if layout == "kept" else "kept"
    assert f"0.{layout}" in tensors and f"0.{other}" not in tensors
    kept = int(tensors["0.counts"].sum())
    position_bytes = tensors[f"0.{layout}"].nbytes
    assert position_bytes == (HEADS * math.ceil(TOKENS / 8) if layout == "kept" else 2 * kept)
    assert position_bytes <= min(HEADS * math.ceil(TOKENS / 8), 2 * kept)
    # Either layout restores the same layers and bias (older blobs carry numbers).
    back, bias = restore_state(tensors, compressed.meta, LAYERS)
    old_back, old_bias = restore_state(with_index_positions(tensors), compressed.meta, LAYERS)
    for (k, v), (k2, v2), b, b2 in zip(back, old_back, bias, old_bias):
        assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(b, b2)


def test_global_budgets_let_layers_keep_different_shares():
    layers, stats = _state()
    stats.reconstruction = [torch.rand(HEADS, TOKENS) * scale for scale in (1.0, 0.2, 3.0)]  # layer 2 scores high
    method = by_name("kvzip-global@0.7")
    assert method.budgets == "global"
    compressed = method.compress(layers, stats)
    counts = [int(torch.isfinite(bias).sum()) for bias in compressed.head_bias]
    assert sum(counts) == math.ceil(0.7 * (LAYERS * HEADS * TOKENS))
    assert counts[2] > counts[0] > counts[1]
    for bias in compressed.head_bias:  # sinks and recent tokens are kept everywhere
        assert torch.isfinite(bias[:, :4]).all() and torch.isfinite(bias[:, -32:]).all()
    evicted = [torch.where(torch.arange(TOKENS) % 3 == 0, -torch.inf, 0.0).expand(HEADS, -1) for _ in range(LAYERS)]
    again = method.compress(layers, stats, evicted)
    for bias in again.head_bias:  # an entry evicted before stays evicted
        assert not torch.isfinite(bias[:, 6:-32:3]).any()


def test_the_service_config_takes_global_budgets():
    from statekeeper.compression import from_config
    from statekeeper.config import CompressionConfig

    compressor = from_config(CompressionConfig(budgets="global", keep=0.4, codec="int4-v3-rot-g32-s1"))
    assert compressor.inner.budgets == "global" and compressor.codec.value_bits == 3
    with pytest.raises(ValueError):
        CompressionConfig(budgets="everything")


@pytest.mark.parametrize("budgets", ["uniform", "adaptive"])
def test_a_wider_live_selection_stores_positions_only(budgets):
    """live_keep 0.6 over keep 0.3: the same rows and bias as keep 0.3 alone, plus the 0.6 selection's bits
    (live_bias), which holds every kept entry; through a codec too."""
    from statekeeper.compression.head_budget import live_bias

    layers, stats = _state()
    narrow = HeadBudgetEviction("h", "expected", keep=0.3, budgets=budgets).compress(layers, stats)
    wide = HeadBudgetEviction("h", "expected", keep=0.6, budgets=budgets).compress(layers, stats)
    method = HeadBudgetEviction("h", "expected", keep=0.3, budgets=budgets, live_keep=0.6)
    both = method.compress(layers, stats)
    assert all(torch.equal(a, b) for a, b in zip(both.head_bias, narrow.head_bias))
    assert narrow.stored_bytes < both.stored_bytes < narrow.stored_bytes + LAYERS * HEADS * (TOKENS // 8 + 1) + 1
    named = dict(both.tensors)
    live = live_bias(named, TOKENS, LAYERS)
    assert all(torch.equal(torch.isfinite(a), torch.isfinite(b)) for a, b in zip(live, wide.head_bias))
    assert live_bias(dict(narrow.tensors), TOKENS, LAYERS) is None
    coded = by_name("expected-uniform-live0.6@0.3+int4").compress(layers, stats)
    assert torch.equal(dict(coded.tensors)["0.live"], named["0.live"]) if budgets == "uniform" else True
    for bad in ({"keep": 0.5, "live_keep": 0.4}, {"keep": 0.3, "live_keep": 0.6, "merge": True}):
        with pytest.raises(ValueError, match="live_keep"):
            HeadBudgetEviction("h", "expected", budgets=budgets, **bad)
