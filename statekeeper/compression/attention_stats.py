"""Attention statistics gathered while a conversation is generated (Krul §5), without a global switch to
eager attention and without keeping attention maps.

The model runs with the "statekeeper" attention function: SDPA as usual, plus, only while a collector is
active (the `collecting` context manager), the attention rows of a few sampled queries per layer:
- the I-R test of Krul §4: the attention mass on the initial 10% and recent 10% of positions,
- the inter-layer distance of attention maps: the squared Euclidean distance between two layers' maps is
  a sum over query rows, so it is accumulated row by row (Krul §5's token-wise partition) and only an
  [L, L] matrix persists; one forward's sampled rows are held until its last layer, then dropped,
- the attention each key received (the H2O score) for eviction baselines,
- the last `query_window` query vectors of every layer (fp16), from which the per-head scorers
  (compression/scorers.py) estimate what future queries will attend to, as SnapKV's observation window
  and kvpress's ExpectedAttention do.
Persistent memory: L*L + 2*L floats + L floats per history token, plus the query window (2.2 MB for
SmolLM2: 5% of the KV of a 1,000-token conversation)."""

from __future__ import annotations

import contextvars
import copy
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from statekeeper.compression.reconstruction import FusedReconstructionScores, attention_with_lse

ATTENTION_NAME = "statekeeper"
_active: contextvars.ContextVar["AttentionStats | None"] = contextvars.ContextVar("statekeeper_stats", default=None)
_bias: contextvars.ContextVar["list | None"] = contextvars.ContextVar("statekeeper_head_bias", default=None)


@dataclass(slots=True)
class AttentionStats:
    num_layers: int
    prefill_queries: int = 4  # sampled query rows per prefill chunk
    decode_every: int = 8  # decode steps between sampled rows (4 cost 7% of decode time at 2k tokens)
    query_window: int = 32  # recent queries kept per layer for the per-head scorers
    ir_fraction: float = 0.1
    ir_mass: torch.Tensor = field(init=False)
    ir_rows: torch.Tensor = field(init=False)
    sq_distance: torch.Tensor = field(init=False)
    distance_rows: int = 0
    key_scores: torch.Tensor = field(init=False)  # [L, tokens]: attention received, summed over rows
    reconstruction: list | None = None  # per layer [kv_heads, tokens], from ReconstructionScores (KVzip)
    recent_queries: list = field(init=False)  # per layer [query_heads, <= query_window, head_dim] fp16
    _pending: dict = field(init=False, default_factory=dict)
    _decode_steps: int = 0

    def __post_init__(self):
        self.ir_mass = torch.zeros(self.num_layers, dtype=torch.float64)
        self.ir_rows = torch.zeros(self.num_layers, dtype=torch.float64)
        self.sq_distance = torch.zeros(self.num_layers, self.num_layers, dtype=torch.float64)
        self.key_scores = torch.zeros(self.num_layers, 0)
        self.recent_queries = [None] * self.num_layers

    @property
    def nbytes(self) -> int:
        queries = sum(q.nbytes for q in self.recent_queries if q is not None)
        return self.ir_mass.nbytes + self.ir_rows.nbytes + self.sq_distance.nbytes + self.key_scores.nbytes + queries

    def snapshot(self) -> "AttentionStats":
        """A copy to rewind to: a forward that stops part way (ModelWorker.prefill's give_way) would otherwise
        leave its first layers' rows counted, and count them again when it runs again."""
        return copy.deepcopy(self)

    def rewind(self, snapshot: "AttentionStats") -> None:
        for each in fields(self):
            setattr(self, each.name, getattr(snapshot, each.name))

    def _remember_queries(self, layer: int, query: torch.Tensor) -> None:
        recent = query[0, :, -self.query_window :].to(torch.float16)
        previous = self.recent_queries[layer]
        if previous is not None and recent.shape[1] < self.query_window:
            recent = torch.cat([previous, recent], dim=1)[:, -self.query_window :]
        self.recent_queries[layer] = recent

    def ir_scores(self) -> torch.Tensor:
        """Per layer: mean attention mass on the initial and recent 10% of positions (Krul §4)."""
        return (self.ir_mass / self.ir_rows.clamp_min(1)).float()

    def distances(self) -> torch.Tensor:
        """Per layer pair: Euclidean distance of their attention maps over the sampled rows."""
        return (self.sq_distance.clamp_min(0) / max(1, self.distance_rows)).sqrt().float()

    def _sample(self, num_queries: int) -> torch.Tensor | None:
        if num_queries == 1:
            self._decode_steps += 1
            return torch.tensor([0]) if self._decode_steps % self.decode_every == 0 else None
        count = min(self.prefill_queries, num_queries)
        if not count:  # prefill_queries 0: the recent queries only (what the per-head scorers read)
            return None
        return torch.linspace(num_queries - 1, 0, count).round().long().unique()

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        self._remember_queries(layer, query)
        if layer == 0:
            self._pending = {"rows": self._sample(query.shape[2])}
        rows = self._pending["rows"]
        if rows is None:
            return
        num_keys, num_queries = key.shape[2], query.shape[2]
        kv_heads, query_heads, count = key.shape[1], query.shape[1], len(rows)
        # Query head h*groups + g reads KV head h (GQA): group the queries instead of copying the keys.
        q = query[0, :, rows].float().reshape(kv_heads, query_heads // kv_heads * count, -1)
        scores = torch.matmul(q, key[0].float().transpose(1, 2)).reshape(query_heads, count, num_keys) * scaling
        positions = num_keys - num_queries + rows  # absolute position of each sampled query
        scores.masked_fill_(torch.arange(num_keys)[None, None, :] > positions[None, :, None], -math.inf)
        probs = torch.softmax(scores, dim=-1)  # [Hq, s, n]
        lengths = positions + 1
        initial = torch.arange(num_keys)[None, :] < torch.ceil(self.ir_fraction * lengths)[:, None]
        recent = torch.arange(num_keys)[None, :] >= torch.floor((1 - self.ir_fraction) * lengths)[:, None]
        region = (initial | recent).float()  # [s, n]
        self.ir_mass[layer] += float((probs * region[None]).sum(-1).sum())
        self.ir_rows[layer] += probs.shape[0] * probs.shape[1]
        if self.key_scores.shape[1] < num_keys:  # grown in chunks, not one column per decode step
            grown = torch.zeros(self.num_layers, num_keys + 256)
            grown[:, : self.key_scores.shape[1]] = self.key_scores
            self.key_scores = grown
        self.key_scores[layer, :num_keys] += probs.sum(dim=(0, 1))
        self._pending[layer] = probs.reshape(-1)
        if layer == self.num_layers - 1:
            maps = torch.stack([self._pending[i] for i in range(self.num_layers)]).double()
            norms = (maps * maps).sum(1)
            self.sq_distance += norms[:, None] + norms[None, :] - 2 * maps @ maps.T  # a² + b² - 2ab (Krul §7)
            self.distance_rows += len(rows)
            self._pending = {}


@dataclass(slots=True)
class ReconstructionScores:
    """KVzip-style scores (context reconstruction): while the model is made to repeat the history, the
    most attention each history (KV head, token) receives from any repeating query, max over the query
    heads of its GQA group. Collected through the same attention hook as AttentionStats, for every
    query row; the attention bias of a restored state is honoured. The reference: the service scores with
    compression/reconstruction.py's FusedReconstructionScores (one attention instead of this second one)."""

    num_layers: int
    history_tokens: int
    scores: list = field(init=False)

    def __post_init__(self):
        self.scores = [None] * self.num_layers

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        kv_heads, num_keys = key.shape[1], key.shape[2]
        query_heads, num_queries = query.shape[1], query.shape[2]
        q = query[0].float().reshape(kv_heads, query_heads // kv_heads * num_queries, -1)
        logits = torch.matmul(q, key[0].float().transpose(1, 2)) * scaling  # [Hkv, G*s, n]
        biases = _bias.get()
        if biases is not None and biases[layer] is not None:
            covered = min(biases[layer].shape[1], num_keys)
            logits[:, :, :covered] += biases[layer][:, None, :covered]
        positions = (num_keys - num_queries + torch.arange(num_queries)).repeat(query_heads // kv_heads)
        logits.masked_fill_(torch.arange(num_keys)[None, None, :] > positions[None, :, None], -math.inf)
        best = torch.softmax(logits, dim=-1)[:, :, : self.history_tokens].amax(dim=1)  # [Hkv, history]
        previous = self.scores[layer]
        self.scores[layer] = best if previous is None else torch.maximum(previous, best)


def _attention_with_stats(module, query, key, value, attention_mask, **kwargs):
    if key.dtype != query.dtype:  # a cache kept in another dtype (WorkerConfig.kv_dtype): attend in the cache's
        output, weights = _attention_with_stats(module, query.to(key.dtype), key, value, attention_mask, **kwargs)
        return output.to(query.dtype), weights
    biases = _bias.get()
    stats = _active.get()
    if isinstance(stats, FusedReconstructionScores):  # KVzip scoring: output and scores from one attention
        scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        bias = None if biases is None else biases[module.layer_idx]
        return stats.attend(module.layer_idx, query, key, value, bias, scaling), None
    if biases is not None and biases[module.layer_idx] is not None:
        output = _biased_attention(query, key, value, attention_mask, biases[module.layer_idx],
                                   kwargs.get("scaling") or query.shape[-1] ** -0.5)
    else:
        output = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if stats is not None:
        scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
        stats.observe(module.layer_idx, query, key, scaling)
    return output


attention_with_stats = _attention_with_stats  # for the packed forward, which calls it per conversation


def _biased_attention(query, key, value, attention_mask, bias: torch.Tensor, scaling: float):
    """SDPA with a per-KV-head additive bias on the history positions: -inf for a token this head evicted,
    log(votes) for a token that carries merged ones (KeepKV's electoral votes), 0 otherwise. The same
    result as `_biased_attention_reference` at no per-step copy of K or V: `bias` is normally the cache's
    buffer (KVCache.attention_bias, [kv_heads, width >= keys], zero past the history), so a decode step's
    mask is a view of it. One query (decode): a KV head's query heads become its query rows (transformers'
    pack_gqa), and the [1, Hkv, 1, n] mask broadcasts over them. Several (prefill) on CPU under a plain
    causal mask: packed the same way, the history under the broadcast bias and the queries' own keys
    causal, merged by log-sum-exp (reconstruction.attention_with_lse). Otherwise one SDPA call per
    position in the GQA group, each on all KV heads, so the [1, Hkv, s, n] mask is built once per layer
    and never repeated over query heads. All run CPU SDPA's flash kernel, as the unbiased path does
    (BENCHMARKS.md "Decode speed of a restored compressed session")."""
    batch, query_heads, num_queries, head_dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    groups = query_heads // kv_heads
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] != 1:
        return _biased_attention_reference(query, key, value, attention_mask, bias, scaling)  # a per-head mask
    if num_queries > 1 and _split_applies(query, attention_mask, bias, num_keys):
        # The keys before the queries under the broadcast bias, the queries' own keys causal, merged by
        # their log-sum-exps: no [s, n] mask at all (12-17% less than the loop below at 50-512 queries
        # over 2k keys; BENCHMARKS.md "Decode speed of a restored compressed session").
        rows = query[0].reshape(kv_heads, groups * num_queries, head_dim)  # query head h * G + g: row g * s + i
        output, _ = attention_with_lse(rows, key, value, bias, scaling, num_queries)
        grouped = output.reshape(kv_heads, groups, num_queries, -1)
        return grouped.permute(2, 0, 1, 3).reshape(batch, num_queries, query_heads, -1), None
    if bias.shape[1] < num_keys:  # a bare history bias: the positions past it are unbiased
        bias = torch.cat([bias, bias.new_zeros(kv_heads, num_keys - bias.shape[1])], dim=1)
    if (num_queries > 1 and batch == 1 and query.device.type != "cpu"
            and packed_calls(kv_heads, groups, num_queries, num_keys, query.element_size()) < groups):
        return packed_biased_attention(query, key, value, attention_mask, bias, scaling), None
    mask = bias[None, :, None, :num_keys].to(query.dtype)  # [1, Hkv, 1, n]: a view of the buffer
    if attention_mask is None and num_queries > 1:
        attention_mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device).tril(
            num_keys - num_queries)
    if attention_mask is not None:
        mask = mask.masked_fill(~attention_mask, -math.inf) if attention_mask.dtype == torch.bool else mask + attention_mask
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if num_queries == 1:
        packed = query.reshape(batch, kv_heads, groups, head_dim)  # query head h*groups + g reads KV head h
        output = sdpa(packed, key, value, attn_mask=mask, scale=scaling).reshape(batch, query_heads, 1, -1)
        return output.transpose(1, 2).contiguous(), None
    output = query.new_empty(batch, query_heads, num_queries, value.shape[-1])
    for group in range(groups):  # query heads group, group + groups, ...: one per KV head
        output[:, group::groups] = sdpa(query[:, group::groups], key, value, attn_mask=mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


# Bytes of the additive mask one packed SDPA call reads (packed_biased_attention): longer prefills go in
# several calls of fewer queries each. A memory bound, not a speed setting: the mask is a transient.
PACKED_MASK_BYTES = 64 << 20


def packed_biased_attention(query, key, value, attention_mask, bias: torch.Tensor, scaling: float,
                            max_mask_bytes: int = PACKED_MASK_BYTES) -> torch.Tensor:
    """A prefill's attention with a per-KV-head `bias` ([Hkv, >= n]) for one sequence, GQA packed: a KV
    head's query heads become its query rows (row g * c + i: query head h * G + g, query i of a piece of c),
    so each call reads K and V once under an [Hkv, G * c, n] mask (the bias plus the shared mask's rows
    repeated per group), instead of once per group: on an H200 2.7x less attention time than the loop over
    groups for 48 queries over 16k keys of Llama 8B's shape (BENCHMARKS.md, issue 34; `packed_calls` says
    where it is used). [1, s, Hq, d] out, as `_biased_attention`."""
    _, query_heads, num_queries, head_dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    groups = query_heads // kv_heads
    shared = _shared_mask(attention_mask, num_queries, num_keys, query.dtype, query.device)  # [s, n] additive
    head_bias = bias[:, None, :num_keys].to(query.dtype)  # [Hkv, 1, n]
    calls = packed_calls(kv_heads, groups, num_queries, num_keys, query.element_size(), max_mask_bytes)
    piece = -(-num_queries // calls)
    output = query.new_empty(1, num_queries, query_heads, value.shape[-1])
    for start in range(0, num_queries, piece):
        end = min(start + piece, num_queries)
        rows = query[0, :, start:end].reshape(kv_heads, groups * (end - start), head_dim)
        mask = head_bias + shared[start:end].repeat(groups, 1)[None]  # [Hkv, G * c, n]
        out = torch.nn.functional.scaled_dot_product_attention(rows[None], key, value, attn_mask=mask[None],
                                                               scale=scaling)
        output[0, start:end] = out[0].reshape(query_heads, end - start, -1).transpose(0, 1)
    return output


def packed_calls(kv_heads: int, groups: int, num_queries: int, num_keys: int, element_bytes: int,
                 max_mask_bytes: int = PACKED_MASK_BYTES) -> int:
    """SDPA calls `packed_biased_attention` makes: each reads all of K and V, as each of the per-group
    loop's `groups` calls does, so the GPU packs only where it makes fewer (on an H200 at 16k keys of Llama
    8B's shape: 48 queries in 1 call took 0.37x the loop's time, 512 queries in 9 calls 2.3x; BENCHMARKS.md)."""
    per_query = kv_heads * groups * num_keys * element_bytes
    return -(-num_queries // max(1, max_mask_bytes // per_query))


_shared_built: list = [None]  # (a weak reference to the last mask, dtype, its additive rows): a forward's layers share it


def _shared_mask(attention_mask, num_queries: int, num_keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[s, n] additive (0 or -inf, or the mask's own values) from a [1, 1, s or 1, n] mask shared by every
    head; causal where there is none. Built once per mask tensor (transformers hands every layer the same)."""
    built = _shared_built[0]
    if (attention_mask is not None and built is not None and built[0]() is attention_mask and built[1] == dtype
            and built[2].shape == (num_queries, num_keys)):
        return built[2]
    if attention_mask is None:
        allowed = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)
    else:
        rows = attention_mask[0, 0, :, :num_keys]
        allowed = rows.expand(num_queries, num_keys) if len(rows) == 1 else rows[-num_queries:]
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        shared = allowed.to(dtype)
    else:
        shared = torch.zeros(num_queries, num_keys, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)
    if attention_mask is not None and shared.numel() * shared.element_size() <= PACKED_MASK_BYTES:
        _shared_built[0] = (weakref.ref(attention_mask), dtype, shared)
    return shared


def _split_applies(query, attention_mask, bias: torch.Tensor, num_keys: int) -> bool:
    """Whether a prefill can run as reconstruction.attention_with_lse does: CPU, one sequence, a mask that
    is only causal, and no bias on the queries' own keys (tokens past the restored history)."""
    batch, _, num_queries, _ = query.shape
    if query.device.type != "cpu" or batch != 1 or bool(bias[:, num_keys - num_queries : num_keys].any()):
        return False
    return attention_mask is None or _is_causal(attention_mask, num_queries, num_keys)


_causal_checked = [None]  # a weak reference to the last mask found causal: a forward hands every layer the same one


def _is_causal(attention_mask: torch.Tensor, num_queries: int, num_keys: int) -> bool:
    """Whether a [1, 1, s, n] boolean mask lets query i see keys 0 .. n - s + i and nothing else; checked
    once per mask tensor (a forward's layers share it; transformers builds a new one per forward)."""
    if _causal_checked[0] is not None and _causal_checked[0]() is attention_mask:
        return True
    if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (1, 1, num_queries, num_keys):
        return False
    before = num_keys - num_queries
    own = torch.ones(num_queries, num_queries, dtype=torch.bool, device=attention_mask.device).tril()
    causal = bool(attention_mask[0, 0, :, :before].all()) and torch.equal(attention_mask[0, 0, :, before:], own)
    if causal:
        _causal_checked[0] = weakref.ref(attention_mask)
    return causal


def _biased_attention_reference(query, key, value, attention_mask, bias: torch.Tensor, scaling: float):
    """The plain version `_biased_attention` replaces (tests compare the two): K and V repeated for every
    query head, the [1, Hq, s, n] mask rebuilt from `bias` (any width) on every call."""
    batch, query_heads, num_queries, _ = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    groups = query_heads // kv_heads
    head_bias = torch.zeros(kv_heads, num_keys, dtype=query.dtype, device=query.device)
    covered = min(bias.shape[1], num_keys)
    head_bias[:, :covered] = bias[:, :covered]
    mask = head_bias.repeat_interleave(groups, 0)[None, :, None, :]  # [1, Hq, 1, n]
    if attention_mask is None:
        allowed = torch.ones(num_queries, num_keys, dtype=torch.bool, device=query.device).tril(num_keys - num_queries)
        attention_mask = allowed[None, None]
    if attention_mask.dtype == torch.bool:
        mask = mask.masked_fill(~attention_mask, -math.inf)
    else:
        mask = mask + attention_mask
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def install(model, attention=None) -> None:
    """Switches the model to the "statekeeper" attention function (SDPA plus optional statistics), or to
    `attention`, which wraps it (statekeeper/batch_forward.py)."""
    AttentionInterface.register(ATTENTION_NAME, attention or _attention_with_stats)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)


@contextmanager
def head_bias(biases: list | None):
    """Per-layer [kv_heads, tokens] attention biases apply only inside this block, on this thread."""
    token = _bias.set(biases)
    try:
        yield
    finally:
        _bias.reset(token)


@contextmanager
def collecting(stats: AttentionStats | None):
    """Statistics are gathered only inside this block, on this thread."""
    token = _active.set(stats)
    try:
        yield stats
    finally:
        _active.reset(token)
