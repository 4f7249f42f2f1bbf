import copy

import pytest
import torch

from statekeeper.compression.attention_stats import AttentionStats, collecting


def _eager_attentions(worker, tokens):
    eager = copy.deepcopy(worker.model)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([tokens]), output_attentions=True)
    return [a[0] for a in out.attentions]  # per layer [heads, q, k]


def test_statistics_match_eager_attention_weights(tiny_worker):
    tokens = list(range(5, 45))
    stats = AttentionStats(tiny_worker.num_layers, prefill_queries=len(tokens))
    cache = tiny_worker.new_cache()
    saved_chunk = tiny_worker.config.prefill_chunk_tokens
    tiny_worker.prefill(cache, tokens, stats)  # one chunk: every query row is sampled
    assert saved_chunk >= len(tokens)
    maps = _eager_attentions(tiny_worker, tokens)
    n = len(tokens)
    expected_ir = []
    for layer_map in maps:
        masses = []
        for q in range(n):
            length = q + 1
            region = torch.zeros(n, dtype=torch.bool)
            region[: int(torch.ceil(torch.tensor(0.1 * length)))] = True
            region[int(torch.floor(torch.tensor(0.9 * length))) : length] = True
            masses.append(layer_map[:, q, region].sum(-1))
        expected_ir.append(torch.stack(masses).mean())
    assert torch.allclose(stats.ir_scores(), torch.stack(expected_ir), atol=1e-4)
    flat = torch.stack([m.permute(1, 0, 2).reshape(-1) for m in maps])  # rows ordered as sampled
    expected_distance = torch.cdist(flat[None].double(), flat[None].double())[0] / n**0.5
    assert torch.allclose(stats.distances().double(), expected_distance, atol=1e-4)
    assert torch.allclose(stats.key_scores[:, :n].sum(0), torch.stack(maps).sum(dim=(0, 1, 2)), atol=1e-3)


def test_statistics_are_gathered_only_inside_the_context_and_change_no_output(tiny_worker):
    tokens = list(range(5, 80))
    plain = tiny_worker.prefill(tiny_worker.new_cache(), tokens)
    stats = AttentionStats(tiny_worker.num_layers, decode_every=1)
    cache = tiny_worker.new_cache()
    with_stats = tiny_worker.prefill(cache, tokens, stats)
    assert torch.equal(plain, with_stats)
    rows = stats.distance_rows
    tiny_worker.decode(cache, 7)  # no stats given: nothing recorded
    assert stats.distance_rows == rows
    tiny_worker.decode(cache, 8, stats)
    assert stats.distance_rows == rows + 1


def test_statistics_memory_is_small_next_to_the_kv(tiny_worker):
    stats = AttentionStats(tiny_worker.num_layers)
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, list(range(5, 400)), stats)
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in cache.export_layers())
    assert stats.nbytes <= 0.1 * kv_bytes


def test_a_head_bias_of_minus_infinity_equals_masking_the_token_out(tiny_worker):
    from statekeeper.compression.attention_stats import head_bias

    tokens = list(range(5, 45))
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, tokens)
    layers = cache.export_layers()
    dropped = [3, 17, 30]
    bias = [torch.zeros(tiny_worker.num_kv_heads, len(tokens)) for _ in layers]
    for b in bias:
        b[:, dropped] = -torch.inf
    follow = torch.tensor([[50, 51, 52]])
    from statekeeper.kv_cache import KVCache

    biased = KVCache.from_layers(layers, tiny_worker.device, bias)
    masked = KVCache.from_layers(layers, tiny_worker.device)
    mask = torch.ones(1, len(tokens) + 3, dtype=torch.long)
    mask[0, dropped] = 0
    with torch.inference_mode():
        with_bias = tiny_worker.run_model(biased, follow).logits
        with_mask = tiny_worker.model(input_ids=follow, past_key_values=masked, use_cache=True, attention_mask=mask).logits
        plain = tiny_worker.model(input_ids=follow, past_key_values=KVCache.from_layers(layers, tiny_worker.device),
                                  use_cache=True).logits
        with head_bias(None):
            assert not torch.allclose(with_bias, plain, atol=1e-4)
    assert torch.allclose(with_bias, with_mask, atol=1e-5)


def test_recent_queries_are_kept_per_layer_up_to_the_window(tiny_worker):
    stats = AttentionStats(tiny_worker.num_layers, query_window=8)
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, list(range(5, 25)), stats)
    assert all(q.shape[1] == 8 and q.dtype == torch.float16 for q in stats.recent_queries)
    before = stats.recent_queries[0].clone()
    tiny_worker.decode(cache, 30, stats)
    assert torch.equal(stats.recent_queries[0][:, :7], before[:, 1:])


def test_reconstruction_scores_cover_the_history_and_leave_the_cache_as_it_was(tiny_worker):
    tokens = list(range(5, 60))
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, tokens)
    before = [k.clone() for k, _ in cache.export_layers()]
    scores = tiny_worker.reconstruction_scores(cache, tokens)
    assert cache.num_tokens == len(tokens)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, cache.export_layers()))
    assert len(scores) == tiny_worker.num_layers
    for layer_scores in scores:
        assert layer_scores.shape == (tiny_worker.num_kv_heads, len(tokens))
        assert (layer_scores > 0).all() and (layer_scores <= 1).all()


def test_reconstruction_scores_give_evicted_entries_nothing(tiny_worker):
    from statekeeper.kv_cache import KVCache

    tokens = list(range(5, 60))
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, tokens)
    bias = [torch.zeros(tiny_worker.num_kv_heads, len(tokens)) for _ in range(tiny_worker.num_layers)]
    for b in bias:
        b[0, 10:20] = -torch.inf
    biased = KVCache.from_layers(cache.export_layers(), tiny_worker.device, bias)
    scores = tiny_worker.reconstruction_scores(biased, tokens)
    assert all(not s[0, 10:20].any() and s[1, 10:20].all() for s in scores)


def _votes_bias(kv_heads: int, tokens: int, seed: int = 0) -> torch.Tensor:
    """A restored state's bias: about a third evicted (-inf), some merged rows (log of 2-5 votes), sinks kept."""
    generator = torch.Generator().manual_seed(seed)
    draw = torch.rand(kv_heads, tokens, generator=generator)
    votes = torch.randint(2, 6, (kv_heads, tokens), generator=generator).float()
    bias = torch.where(draw < 0.35, -torch.inf, torch.where(draw > 0.8, votes.log(), 0.0))
    bias[:, :2] = 0.0
    return bias


@pytest.mark.parametrize("num_queries", [1, 9])
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
@pytest.mark.parametrize("bias_width", ["history", "buffer", "over the queries"])
def test_biased_attention_matches_the_reference(num_queries, mask, bias_width):
    from statekeeper.compression.attention_stats import _biased_attention, _biased_attention_reference

    torch.manual_seed(0)
    query_heads, kv_heads, head_dim, history = 9, 3, 64, 40  # SmolLM2's GQA groups of 3
    num_keys = history + num_queries + 2  # the last keys lie past the bias: tokens added since the restore
    query = torch.randn(1, query_heads, num_queries, head_dim)
    key, value = torch.randn(1, kv_heads, num_keys, head_dim), torch.randn(1, kv_heads, num_keys, head_dim)
    bias = _votes_bias(kv_heads, num_keys if bias_width == "over the queries" else history)
    if bias_width == "buffer":  # as KVCache.attention_bias hands it: wider than the keys, zero past the history
        bias = torch.cat([bias, torch.zeros(kv_heads, 256 - history)], dim=1)
    attention_mask = None
    if mask != "none":
        attention_mask = torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)[None, None]
        if mask == "padding":
            attention_mask[..., 5:8] = False
    fast, _ = _biased_attention(query, key, value, attention_mask, bias, head_dim**-0.5)
    reference, _ = _biased_attention_reference(query, key, value, attention_mask, bias, head_dim**-0.5)
    assert fast.shape == reference.shape == (1, num_queries, query_heads, head_dim)
    assert torch.allclose(fast, reference, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mask", ["none", "causal", "padding", "one row"])
@pytest.mark.parametrize("pieces", [1, 3])
def test_packed_biased_attention_matches_the_reference(mask, pieces):
    """The GPU's prefill path (GQA packed, in pieces of queries where the mask would be large), run here
    on CPU tensors: the same output as the plain reference."""
    from statekeeper.compression.attention_stats import _biased_attention_reference, packed_biased_attention

    torch.manual_seed(0)
    query_heads, kv_heads, head_dim, history, num_queries = 9, 3, 64, 40, 9
    num_keys = history + num_queries
    query = torch.randn(1, query_heads, num_queries, head_dim)
    key, value = torch.randn(1, kv_heads, num_keys, head_dim), torch.randn(1, kv_heads, num_keys, head_dim)
    bias = torch.cat([_votes_bias(kv_heads, history), torch.zeros(kv_heads, 100)], dim=1)
    attention_mask = None
    if mask != "none":
        attention_mask = torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)[None, None]
        if mask == "padding":
            attention_mask[..., 5:8] = False
        if mask == "one row":  # broadcast over the queries: every query sees every key
            attention_mask = torch.ones(1, 1, 1, num_keys, dtype=torch.bool)
    # Bytes for a third of the queries' mask: three calls of three queries each.
    piece_bytes = kv_heads * query_heads // kv_heads * num_keys * 4 * num_queries // pieces
    packed = packed_biased_attention(query, key, value, attention_mask, bias, head_dim**-0.5, piece_bytes)
    reference, _ = _biased_attention_reference(query, key, value, attention_mask, bias, head_dim**-0.5)
    assert packed.shape == reference.shape == (1, num_queries, query_heads, head_dim)
    assert torch.allclose(packed, reference, atol=1e-6, rtol=1e-5)


def test_the_gpu_packs_a_biased_prefill_only_where_it_reads_the_keys_fewer_times():
    """Each packed call reads K and V once, as each of the loop's G calls does: a long prefill whose mask
    would need G calls or more keeps the loop (Llama 8B's shape: 8 KV heads, groups of 4, bfloat16)."""
    from statekeeper.compression.attention_stats import PACKED_MASK_BYTES, packed_calls

    keys = 16384
    assert packed_calls(8, 4, 48, keys + 48, 2) == 1
    assert packed_calls(8, 4, 512, keys + 512, 2) >= 4
    one_call = PACKED_MASK_BYTES // (8 * 4 * keys * 2)
    assert packed_calls(8, 4, one_call, keys, 2) == 1 and packed_calls(8, 4, one_call + 1, keys, 2) == 2


def test_a_restored_state_decodes_as_the_reference_attention_does(tiny_worker, monkeypatch):
    """Prefill (many queries, past the bias) then decode (one query) through the model, with evicted and
    merged entries: the same logits as with the plain reference attention."""
    from statekeeper.compression import attention_stats
    from statekeeper.kv_cache import KVCache

    tokens = list(range(5, 100))
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, tokens)
    layers = cache.export_layers()
    bias = [_votes_bias(tiny_worker.num_kv_heads, len(tokens), seed) for seed in range(tiny_worker.num_layers)]

    def run() -> list[torch.Tensor]:
        restored = KVCache.from_layers(layers, tiny_worker.device, bias)
        logits = [tiny_worker.prefill(restored, list(range(200, 290)))]  # two chunks of the tiny worker's 64
        logits += [tiny_worker.decode(restored, token) for token in (7, 8, 9)]
        return logits

    fast = run()
    monkeypatch.setattr(attention_stats, "_biased_attention", attention_stats._biased_attention_reference)
    reference = run()
    # The fast path merges the history and the new tokens by log-sum-exp, the reference runs one softmax:
    # float32 sums in another order, 1.8e-5 apart at most on this machine's CPU after 90 + 3 tokens (on
    # another CPU's kernels they agreed to 1e-5). A wrong bias or mask moves logits by far more than 1e-4.
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(fast, reference))
    assert [a.argmax() for a in fast] == [b.argmax() for b in reference]
