import torch

from kernels.keepkv import merge_into_kept


def _attention(query, keys, values, votes, scale):
    logits = keys @ query * scale + votes.log()
    return torch.softmax(logits, 0) @ values


def test_merging_is_lossless_for_the_query_it_was_computed_with():
    """KeepKV Theorem 3: with votes honoured, the merged cache gives the same output for q."""
    torch.manual_seed(0)
    tokens, dim, scale = 12, 8, 8 ** -0.5
    keys, values = torch.randn(tokens, dim, dtype=torch.float64), torch.randn(tokens, dim, dtype=torch.float64)
    query = torch.zeros(dim, dtype=torch.float64)
    query[0] = 1.0
    keys[:, 0] = (2 + torch.rand(tokens, dtype=torch.float64)) / scale  # logits in [2, 3]: the key factor applies
    votes = torch.ones(tokens, dtype=torch.float64)
    kept = torch.zeros(tokens, dtype=torch.bool)
    kept[[0, 3, 7, 11]] = True
    logits = keys @ query * scale
    k, v, p = merge_into_kept(keys, values, votes, logits, kept, ~kept)
    assert k.shape == (4, dim) and p.sum() == tokens
    full = _attention(query, keys, values, votes, scale)
    merged = _attention(query, k, v, p, scale)
    dropped = _attention(query, keys[kept], values[kept], votes[kept], scale)
    assert torch.allclose(merged, full, atol=1e-9) and not torch.allclose(dropped, full, atol=1e-3)


def test_tokens_that_may_not_merge_are_dropped_and_carriers_without_members_are_unchanged():
    torch.manual_seed(1)
    keys, values = torch.randn(6, 4), torch.randn(6, 4)
    votes = torch.tensor([1.0, 1, 1, 3, 1, 1])
    kept = torch.tensor([True, False, False, True, False, True])
    mergeable = torch.zeros(6, dtype=torch.bool)
    k, v, p = merge_into_kept(keys, values, votes, torch.randn(6), kept, mergeable)
    assert torch.equal(k, keys[kept]) and torch.equal(v, values[kept]) and p.tolist() == [1, 3, 1]
