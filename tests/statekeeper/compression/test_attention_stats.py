import copy

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
