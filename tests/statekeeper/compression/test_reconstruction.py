import math

import pytest
import torch

from statekeeper.compression.attention_stats import ReconstructionScores, collecting
from statekeeper.compression.reconstruction import (PROMPT, REFERENCE_SCORING, ReconstructionScoring,
                                                    attention_with_lse, attention_with_lse_reference,
                                                    history_probability_max, plan_steps)
from statekeeper.kv_cache import KVCache

FULL = ReconstructionScoring(fused=True, context_chunk_tokens=None)
CHUNKED = ReconstructionScoring(fused=True, context_chunk_tokens=16)


def _rows_and_kv(before: int, queries: int, seed: int = 0, kv_heads: int = 2, groups: int = 3, dim: int = 16):
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(kv_heads, groups * queries, dim, generator=generator)
    key = torch.randn(1, kv_heads, before + queries, dim, generator=generator)
    value = torch.randn(1, kv_heads, before + queries, dim, generator=generator)
    return rows, key, value


def _history_bias(kv_heads: int, width: int, history: int) -> torch.Tensor:
    """Evictions (-inf) and merged votes (log 3) on the history, zero past it (as the cache's buffers)."""
    bias = torch.zeros(kv_heads, width)
    bias[0, 3:7] = -math.inf
    bias[1, 1] = math.log(3.0)
    bias[:, history:] = 0.0
    return bias


@pytest.mark.parametrize("before,queries,biased", [(0, 7, False), (20, 7, False), (20, 7, True), (9, 1, True)])
def test_fused_attention_matches_the_plain_one(before, queries, biased):
    rows, key, value = _rows_and_kv(before, queries)
    bias = _history_bias(2, before + queries + 30, before) if biased else None
    output, lse = attention_with_lse(rows, key, value, bias, 0.25, queries)
    expected_output, expected_lse = attention_with_lse_reference(rows, key, value, bias, 0.25, queries)
    assert torch.allclose(output, expected_output, atol=1e-5) and torch.allclose(lse, expected_lse, atol=1e-5)


def test_fused_attention_matches_sdpa():
    from torch.nn.functional import scaled_dot_product_attention

    before, queries, kv_heads, groups = 12, 5, 2, 3
    rows, key, value = _rows_and_kv(before, queries, kv_heads=kv_heads, groups=groups)
    output, _ = attention_with_lse(rows, key, value, None, 0.25, queries)
    # rows back to [1, Hq, s, d]: query head h * G + g is row block g of KV head h
    query = rows.reshape(kv_heads * groups, queries, -1)[None]
    allowed = torch.ones(queries, before + queries, dtype=torch.bool).tril(before)
    expected = scaled_dot_product_attention(query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1),
                                            attn_mask=allowed, scale=0.25)
    assert torch.allclose(output.reshape(kv_heads * groups, queries, -1), expected[0], atol=1e-5)


def test_history_probability_max_is_the_softmax_max():
    before, queries, history = 20, 6, 15
    rows, key, value = _rows_and_kv(before, queries)
    bias = _history_bias(2, before + queries, history)
    _, lse = attention_with_lse_reference(rows, key, value, bias, 0.25, queries)
    best = history_probability_max(rows, key, lse, bias, 0.25, history)
    logits = torch.matmul(rows, key[0].transpose(1, 2)) * 0.25 + bias[:, None, :]
    allowed = torch.ones(queries, before + queries, dtype=torch.bool).tril(before).repeat(3, 1)
    probabilities = torch.softmax(logits.masked_fill(~allowed, -math.inf), dim=-1)
    assert torch.allclose(best, probabilities[:, :, :history].amax(dim=1), atol=1e-6)
    assert not best[0, 3:7].any() and (best[1] > 0).all()


def test_plan_repeats_each_chunk_after_its_own_prompt():
    history, prompt = list(range(100, 150)), [1, 2, 3]
    steps = plan_steps(history, prompt, job_tokens=8, context_chunk_tokens=20)
    fed = [token for step in steps for token in step.tokens]
    assert fed == prompt + history[:20] + prompt + history[20:40] + prompt + history[40:]
    assert all(len(step.tokens) <= 8 for step in steps)
    starts = [i for i, step in enumerate(steps) if step.is_chunk_start]
    assert [steps[i].tokens[:3] for i in starts] == [prompt, prompt]  # chunks 2 and 3 (the first needs no crop)
    whole = plan_steps(history, prompt, job_tokens=8, context_chunk_tokens=None)
    assert [t for step in whole for t in step.tokens] == prompt + history and not any(s.is_chunk_start for s in whole)


def _prefilled(worker, tokens):
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    return cache


def test_fused_scores_equal_the_reference_collector(tiny_worker):
    tokens = list(range(5, 90))
    cache = _prefilled(tiny_worker, tokens)
    reference = tiny_worker.reconstruction_scores(cache, tokens, REFERENCE_SCORING)
    fused = tiny_worker.reconstruction_scores(cache, tokens, FULL)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(fused, reference))


def test_fused_scores_equal_the_reference_under_a_bias(tiny_worker):
    tokens = list(range(5, 60))
    cache = _prefilled(tiny_worker, tokens)
    bias = [_history_bias(tiny_worker.num_kv_heads, len(tokens), len(tokens)) for _ in range(tiny_worker.num_layers)]
    scores = {}
    for scoring in (REFERENCE_SCORING, FULL, CHUNKED):
        biased = KVCache.from_layers(cache.export_layers(), tiny_worker.device, bias)
        scores[scoring] = tiny_worker.reconstruction_scores(biased, tokens, scoring)
        assert biased.num_tokens == len(tokens)
        assert all(not s[0, 3:7].any() and (s[0, 7:] > 0).all() and (s[1] > 0).all() for s in scores[scoring])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(scores[FULL], scores[REFERENCE_SCORING]))


def test_chunked_scores_are_the_max_over_chunks_repeated_alone(tiny_worker):
    """Each repetition chunk attends to the history, its prompt and itself only: the same scores as the
    reference collector fed `prompt + chunk` on the bare history, chunk after chunk, max over them."""
    tokens, size = list(range(5, 75)), 24
    cache = _prefilled(tiny_worker, tokens)
    before = [k.clone() for k, _ in cache.export_layers()]
    scores = tiny_worker.reconstruction_scores(cache, tokens, ReconstructionScoring(context_chunk_tokens=size))
    assert cache.num_tokens == len(tokens)
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, cache.export_layers()))
    prompt = tiny_worker.tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = ReconstructionScores(tiny_worker.num_layers, len(tokens))
    with torch.inference_mode():
        for start in range(0, len(tokens), size):
            cache.truncate(len(tokens))
            with collecting(expected):
                tiny_worker.run_model(cache, torch.tensor([prompt + tokens[start : start + size]]))
    cache.truncate(len(tokens))
    for mine, theirs in zip(scores, expected.scores):
        assert mine.shape == (tiny_worker.num_kv_heads, len(tokens))
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6)


def test_int8_scoring_is_close_and_leaves_the_model_as_it_was(tiny_worker):
    tokens = list(range(5, 70))
    cache = _prefilled(tiny_worker, tokens)
    exact = tiny_worker.reconstruction_scores(cache, tokens, FULL)
    int8 = tiny_worker.reconstruction_scores(cache, tokens, ReconstructionScoring(int8_linears=True))
    linears = [m for layer in tiny_worker.decoder_layers() for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" not in vars(m) for m in linears)  # the int8 forwards are gone
    for a, b in zip(exact, int8):
        assert a.shape == b.shape
        assert torch.corrcoef(torch.stack([a.flatten().log(), b.flatten().log()]))[0, 1] > 0.95
    after = tiny_worker.reconstruction_scores(cache, tokens, FULL)
    assert all(torch.equal(a, b) for a, b in zip(exact, after))


def test_scoring_names_round_trip():
    for name in ("reference", "fused-c0", "fused-c512", "fused-c256-int8", "fused-c0-int8"):
        assert ReconstructionScoring.by_name(name).name == name
    with pytest.raises(ValueError):
        ReconstructionScoring.by_name("fused-int4")
    with pytest.raises(ValueError):
        ReconstructionScoring(fused=False, context_chunk_tokens=None, int8_linears=True)


def test_windowed_scores_equal_the_full_ones_when_the_window_covers_everything(tiny_worker):
    tokens = list(range(5, 80))
    cache = _prefilled(tiny_worker, tokens)
    full = tiny_worker.reconstruction_scores(cache, tokens, FULL)
    wide = tiny_worker.reconstruction_scores(cache, tokens, ReconstructionScoring(window_tokens=200))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(full, wide))
    narrow = tiny_worker.reconstruction_scores(cache, tokens, ReconstructionScoring(window_tokens=16))
    assert cache.num_tokens == len(tokens)
    for a, b in zip(full, narrow):  # every history entry still gets a score, none above a probability
        assert a.shape == b.shape and (b > 0).all() and (b <= 1).all()
