"""KeepKV's merge of evicted tokens into kept ones (../shared/papers/004_09f6c1a90b421445.txt,
Algorithm 1 steps 5a-5f), for one KV head. Torch reference.

Each evicted token joins the kept token whose key is most similar (cosine, as KeepKV and D2O select).
A carrier and the tokens that join it merge into one entry with electoral votes p_r = sum p_i; with
w_i = p_i s_i (s_i = exp(l_i), l_i = q.k_i * scale for the expected query q):
    v_r = sum w_i v_i / sum w_i                                    (ZIP-Merging, value)
    k_r = sum w_i k_i * ln(sum w_i / sum p_i) / sum w_i l_i          (ZIP-Merging, key)
so that p_r exp(q.k_r * scale) = sum p_i s_i: for the query q the attention output is unchanged
(single-step lossless, KeepKV Theorem 3), provided attention weights each entry by its votes (the
caller adds ln p as an attention bias). The pairwise formula is applied to a whole group at once,
which is the same as merging its members one after another. Where the key's correction factor is not
positive or is extreme (the locality assumption fails), the key falls back to the convex combination."""

from __future__ import annotations

import torch

_MAX_FACTOR = 4.0


def merge_into_kept(keys: torch.Tensor, values: torch.Tensor, votes: torch.Tensor, logits: torch.Tensor,
                    kept: torch.Tensor, mergeable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, values: [T, d]; votes: [T] (>= 1); logits: [T], l_i = q.k_i * scale; kept: [T] bool;
    mergeable: [T] bool, the evicted tokens that merge (others are simply dropped). Returns the kept
    tokens' keys, values and votes after merging, in position order."""
    kept_index = kept.nonzero()[:, 0]
    merged_index = (mergeable & ~kept).nonzero()[:, 0]
    k = keys.double()
    if merged_index.numel() == 0:
        return keys[kept_index], values[kept_index], votes[kept_index]
    unit = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    carrier = (unit[merged_index] @ unit[kept_index].T).argmax(dim=1)  # position in kept_index
    members = torch.cat([kept_index, merged_index])
    group = torch.cat([torch.arange(len(kept_index)), carrier])
    log_w = votes[members].double().log() + logits[members].double()  # ln w_i = ln p_i + l_i
    group_max = torch.full((len(kept_index),), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, group, log_w, "amax")
    e = (log_w - group_max[group]).exp()
    total = torch.zeros(len(kept_index), dtype=torch.float64).index_add(0, group, e)
    weight = e / total[group]  # w_i / sum over its group
    vote_sum = torch.zeros(len(kept_index), dtype=torch.float64).index_add(0, group, votes[members].double())

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(kept_index), *x.shape[1:], dtype=torch.float64).index_add(0, group, x)

    merged_values = group_sum(weight[:, None] * values[members].double())
    convex_keys = group_sum(weight[:, None] * k[members])
    log_target = group_max + total.log() - vote_sum.log()  # ln(sum w / sum p)
    weighted_logit = group_sum(weight * logits[members].double())
    factor = log_target / weighted_logit
    usable = torch.isfinite(factor) & (factor > 0) & (factor < _MAX_FACTOR) & (weighted_logit.abs() > 1e-6)
    merged_keys = torch.where(usable[:, None], convex_keys * factor[:, None], convex_keys)
    return merged_keys.to(keys.dtype), merged_values.to(values.dtype), vote_sum.round().to(votes.dtype)
