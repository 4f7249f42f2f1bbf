"""Per-head token scores for eviction: how much attention each (KV head, history token) is expected to
get from future queries. Query-agnostic: they use only what the conversation has already seen (the
next question is unknown at offload time, Krul's challenge 1). Each returns [kv_heads, tokens]; a
token's score is summed over the query heads of its GQA group. `bias` is the state's attention bias
(-inf for tokens already evicted, log(votes) for merged carriers), honoured like the model does.

- SnapKV (the baseline that shows the failure): attention of the last `query_window` queries (the
  end of the previous turn), max-pooled over neighbouring tokens as in SnapKV.
- ExpectedAttention (kvpress): future queries modelled as a Gaussian fitted to the recent queries; a
  key's expected logit under q ~ N(mu, diag(sigma^2)) is mu.k s + 1/2 s^2 sum_i sigma_i^2 k_i^2
  (s the attention scale), softmaxed over keys and weighted by the value norm. Simplification: the
  recent queries are already rotated to their own positions (RoPE), and the covariance is diagonal."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _grouped(queries: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[Hq, W, d] -> [Hkv, groups * W, d]: query head h*groups+g reads KV head h."""
    query_heads, window, dim = queries.shape
    return queries.float().reshape(kv_heads, query_heads // kv_heads * window, dim)


def _with_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return logits if bias is None else logits + bias[:, None, : logits.shape[-1]]


@dataclass(slots=True)
class SnapKVScorer:
    name: str = "snapkv"
    pool: int = 7  # SnapKV's pooling kernel

    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scaling: float,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        kv_heads, tokens, _ = keys.shape
        q = _grouped(queries, kv_heads)
        window = queries.shape[1]
        logits = _with_bias(torch.matmul(q, keys.float().transpose(1, 2)) * scaling, bias)  # [Hkv, G*W, T]
        # The window queries sit at the last `window` positions: each sees the keys up to its own.
        position = (tokens - window + torch.arange(window)).repeat(q.shape[1] // window)
        logits.masked_fill_(torch.arange(tokens)[None, None, :] > position[None, :, None], -torch.inf)
        scores = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=1)
        return F.max_pool1d(scores[None], self.pool, stride=1, padding=self.pool // 2)[0]


@dataclass(slots=True)
class ExpectedAttentionScorer:
    name: str = "expected"
    use_value_norm: bool = True

    def score(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, scaling: float,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        kv_heads = keys.shape[0]
        query_heads, _, dim = queries.shape
        q = queries.float().reshape(kv_heads, query_heads // kv_heads, -1, dim)  # [Hkv, G, W, d]
        mean, variance = q.mean(dim=2), q.var(dim=2, unbiased=False)  # [Hkv, G, d]
        k = keys.float()
        logits = torch.matmul(mean, k.transpose(1, 2)) * scaling  # [Hkv, G, T]
        logits += 0.5 * scaling**2 * torch.matmul(variance, (k * k).transpose(1, 2))
        scores = torch.softmax(_with_bias(logits, bias), dim=-1).nan_to_num(0.0).sum(dim=1)
        if self.use_value_norm:
            scores = scores * values.float().norm(dim=-1)
        return scores


@dataclass(slots=True)
class ReconstructionScorer:
    """KVzip (context reconstruction): scores the worker computed before compression
    (ModelWorker.reconstruction_scores, stored in AttentionStats.reconstruction)."""

    name: str = "kvzip"

    def score(self, keys, values, queries, scaling, bias=None, reconstruction=None) -> torch.Tensor:
        if reconstruction is None:
            raise ValueError("kvzip needs reconstruction scores computed by the worker")
        scores = reconstruction.clone()
        if bias is not None:
            scores[~torch.isfinite(bias[:, : scores.shape[1]])] = 0.0
        return scores


SCORERS = {"snapkv": SnapKVScorer, "expected": ExpectedAttentionScorer, "kvzip": ReconstructionScorer}
