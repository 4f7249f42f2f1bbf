"""Per-head token budgets (TANGRAM, HeteroCache, FairKV: heads differ in how far back they look).

Each (layer, KV head) keeps its top-scored tokens (compression/scorers.py), always with the first
`sink_tokens` and the last `recent_tokens`. How many each head keeps:
- uniform: every head keeps ceil(keep * tokens);
- adaptive (Ada-KV): a layer's heads compete; its scores are flattened over heads and the top
  keep * tokens * heads win, so focused heads give budget to spread-out ones;
- calibrated (TANGRAM §4.1): each head keeps ceil(B * tokens), B measured offline on sample
  conversations (statekeeper/evaluation/calibration.py), so the stored size is known before compressing;
- global (KVzip's non-uniform allocation): all layers' heads compete; the top keep * tokens * heads *
  layers entries win, so layers keep different shares too.
Evicted tokens are dropped, or merged into their most similar kept token with votes (KeepKV,
kernels/keepkv.py). Stored without padding (TANGRAM's ragged layout with one head per group: this
store never feeds a paged kernel, so nothing gains from grouping): per layer the kept rows of all heads
back to back ("i.k", "i.v" [kept, head_dim]), their positions, the count per head ("i.counts") and, when
merging, the votes ("i.votes"). The positions are a bit per (head, token) ("i.kept" [heads, ceil(tokens / 8)]
uint8, `kernels.quant.pack_mask`: 3 bytes per 8 tokens on SmolLM2), or the kept tokens' numbers ("i.index",
int16) where those take fewer bytes (keeping under 1 entry in 16), as all blobs were before the bits;
`kept_rows` reads either. Restore scatters the rows into a dense cache and gives every head an attention
bias: -inf where it evicted, ln(votes) where it merged."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.keepkv import merge_into_kept
from kernels.quant import pack_mask, unpack_mask
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers
from statekeeper.compression.form import StoredForm
from statekeeper.compression.registry import MethodSpec, register
from statekeeper.compression.scorers import SCORERS
from statekeeper.config import check_live_keep

SCORER_NAMES = tuple(SCORERS)


@register
@dataclass(slots=True)
class HeadBudgetEviction:
    name: str
    scorer: str = "expected"  # snapkv | expected | kvzip
    keep: float = 0.5  # fraction of the history's (head, token) entries kept
    budgets: str = "adaptive"  # uniform | adaptive | calibrated | global
    profile: list[list[float]] | None = None  # calibrated: per [layer][head] budget B (TANGRAM eq. 5)
    merge: bool = False  # KeepKV: evicted tokens merge into kept ones
    # A wider selection (its share of entries) whose positions are stored too ("i.live" bits, no rows): the
    # entries a restore attends when it reads their rows from the conversation's exact copy
    # (sessions/exact_copy.py); a restore without one attends to the `keep` rows stored.
    live_keep: float | None = None
    sink_tokens: int = 4
    recent_tokens: int = 32
    spec_names: ClassVar = SCORER_NAMES
    policies: ClassVar = ("heads",)
    form: ClassVar = "heads"

    def __post_init__(self):
        check_live_keep(self.keep, self.live_keep, self.budgets, self.merge)

    @classmethod
    def from_spec(cls, spec: MethodSpec) -> HeadBudgetEviction:
        """`<scorer>[-uniform|-calibrated|-global][-merge][@<keep>]`; calibrated budgets need the caller's
        profile for this scorer with a budget for `keep`."""
        live = [option for option in spec.options if option.startswith("live")]  # -live<share>: live_keep
        unknown = set(spec.options) - {"uniform", "calibrated", "global", "merge", *live}
        if unknown or len(live) > 1:
            raise ValueError(f"unknown options {sorted(unknown or live)} in {spec.text!r}")
        keep = float(spec.own or 0.5)
        budgets = next((o for o in spec.options if o in ("uniform", "calibrated", "global")), "adaptive")
        budget = None
        if budgets == "calibrated":
            profile = spec.profile
            budget = profile.budget_for(keep) if profile is not None and profile.scorer == spec.head else None
            if budget is None:
                raise ValueError(f"{spec.text!r} needs a calibrated {spec.head} profile with a budget for {keep:g}")
        return cls(spec.text, spec.head, keep, budgets, profile=budget, merge="merge" in spec.options,
                   live_keep=float(live[0].removeprefix("live")) if live else None)

    @classmethod
    def from_config(cls, config, profile=None) -> HeadBudgetEviction:
        """Calibrated budgets without a budget for `keep` in `profile` fall back to uniform ones."""
        budgets, budget = config.budgets, None
        if budgets == "calibrated":
            budget = profile.budget_for(config.keep) if profile is not None else None
            budgets = "calibrated" if budget is not None else "uniform"
        return cls("heads", config.scorer, config.keep, budgets, profile=budget, merge=config.merge,
                   live_keep=config.live_keep)

    @staticmethod
    def restore(tensors: dict[str, torch.Tensor], form: StoredForm, num_layers: int) -> tuple[Layers, list]:
        return (restore_layers(tensors, form.num_tokens, num_layers),
                restore_bias(tensors, form.num_tokens, num_layers))

    def compress(self, layers: Layers, stats: AttentionStats | None = None,
                 bias: list[torch.Tensor] | None = None) -> Compressed:
        tensors, head_bias, row_scores = [], [], {}
        biases = [None if bias is None else padded_bias(bias[index], keys.shape[1])
                  for index, (keys, _) in enumerate(layers)]
        if self.budgets == "global":
            scores_by_layer = [self.scores(index, keys, values, stats, biases[index])
                               for index, (keys, values) in enumerate(layers)]
            kept_by_layer = self.select_global(scores_by_layer, biases)
            if self.live_keep is not None:
                live_by_layer = self.select_global(scores_by_layer, biases, self.live_keep)
        for index, (keys, values) in enumerate(layers):
            layer_bias = biases[index]
            if self.budgets == "global":
                scores, kept = scores_by_layer[index], kept_by_layer[index]
                live = live_by_layer[index] if self.live_keep is not None else None
            else:
                scores = self.scores(index, keys, values, stats, layer_bias)
                kept = self.select(scores, layer_bias, None if self.profile is None else self.profile[index])
                live = None if self.live_keep is None else self.select(scores, layer_bias, keep=self.live_keep)
            # KVzip scores come from the worker; recent queries are read only to merge (KeepKV).
            queries = self.recent_queries(stats, index) if self.merge else None
            stored = self.store(keys, values, queries, kept, layer_bias)
            if live is not None:
                stored["live"] = pack_mask(live | kept)
            tensors += [(f"{index}.{name}", tensor) for name, tensor in stored.items()]
            head_bias.append(bias_of(stored, keys.shape[0], keys.shape[1]))
            row_scores[f"{index}.k"] = row_scores[f"{index}.v"] = scores[kept]  # the stored rows' order
        tokens = layers[0][0].shape[1]
        named = dict(tensors)
        return Compressed(restore_layers(named, tokens, len(layers)), sum(t.nbytes for _, t in tensors),
                          form=StoredForm("heads", self.name, num_tokens=tokens), tensors=tensors,
                          rebuild=lambda: restore_layers(named, tokens, len(layers)),
                          head_bias=head_bias, row_scores=row_scores)

    def scores(self, index: int, keys: torch.Tensor, values: torch.Tensor, stats: AttentionStats | None,
               bias: torch.Tensor | None) -> torch.Tensor:
        """[Hkv, T]: how much layer `index`'s heads need each token (higher keeps it)."""
        scorer, scaling = SCORERS[self.scorer](), keys.shape[-1] ** -0.5
        if self.scorer != "kvzip":
            return scorer.score(keys, values, self.recent_queries(stats, index), scaling, bias)
        if stats is None or stats.reconstruction is None:
            raise ValueError(f"{self.name} needs reconstruction scores computed by the worker")
        return scorer.score(keys, values, None, scaling, bias, stats.reconstruction[index])

    def recent_queries(self, stats: AttentionStats | None, index: int) -> torch.Tensor:
        if stats is None or any(q is None for q in stats.recent_queries):
            raise ValueError(f"{self.name} needs the recent queries of the attention statistics")
        return stats.recent_queries[index]

    def _ranked(self, scores: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores with sinks and recent tokens at +inf and evicted entries at -inf, the entries alive)."""
        heads, tokens = scores.shape
        scores = scores.clone()
        alive = torch.ones(heads, tokens, dtype=torch.bool) if bias is None else torch.isfinite(bias[:, :tokens])
        scores[:, : self.sink_tokens] = torch.inf
        scores[:, max(0, tokens - self.recent_tokens) :] = torch.inf
        scores[~alive] = -torch.inf
        return scores, alive

    def select_global(self, scores: list[torch.Tensor], biases: list[torch.Tensor | None],
                      keep: float | None = None) -> list[torch.Tensor]:
        """Global budgets (KVzip's non-uniform allocation): every (layer, head, token) entry competes with
        all the others, so layers as well as heads keep different shares; keep (default self.keep) * all
        entries are kept."""
        keep = self.keep if keep is None else keep
        ranked = [self._ranked(layer_scores, bias) for layer_scores, bias in zip(scores, biases)]
        flat = torch.cat([r.reshape(-1) for r, _ in ranked])
        kept = torch.zeros(len(flat), dtype=torch.bool)
        kept[flat.topk(min(len(flat), math.ceil(keep * len(flat)))).indices] = True
        layers = []
        for (layer_scores, alive), layer_kept in zip(ranked, kept.split([r.numel() for r, _ in ranked])):
            layer_kept = layer_kept.view(layer_scores.shape)
            layers.append((layer_kept | torch.isinf(layer_scores) & (layer_scores > 0)) & alive)
        return layers

    def select(self, scores: torch.Tensor, bias: torch.Tensor | None, budgets: list[float] | None = None,
               keep: float | None = None) -> torch.Tensor:
        """[Hkv, T] bool: the entries each head keeps (sinks and recent tokens even beyond the budget); `keep`
        (default self.keep) for uniform and adaptive budgets."""
        keep = self.keep if keep is None else keep
        heads, tokens = scores.shape
        scores, alive = self._ranked(scores, bias)
        kept = torch.zeros(heads, tokens, dtype=torch.bool)
        if self.budgets == "calibrated":
            if budgets is None:
                raise ValueError(f"{self.name} needs a calibrated per-head profile")
            for head, budget in enumerate(budgets):  # TANGRAM eq. 4: per-head top-ceil(B N)
                kept[head, scores[head].topk(min(tokens, math.ceil(budget * tokens))).indices] = True
        elif self.budgets == "uniform":
            count = min(tokens, math.ceil(keep * tokens))
            kept.scatter_(1, scores.topk(count, dim=1).indices, True)
        else:
            count = min(heads * tokens, math.ceil(keep * tokens * heads))
            kept.view(-1)[scores.view(-1).topk(count).indices] = True
        return (kept | torch.isinf(scores) & (scores > 0)) & alive

    def store(self, keys, values, queries, kept, bias) -> dict[str, torch.Tensor]:
        heads, tokens, _ = keys.shape
        scaling = keys.shape[-1] ** -0.5
        votes = torch.ones(heads, tokens) if bias is None else bias[:, :tokens].exp()
        parts = {"k": [], "v": [], "index": [], "votes": []}
        if self.merge:  # per KV head
            mean_query = queries.float().reshape(heads, -1, queries.shape[-1]).mean(dim=1)
        for head in range(heads):
            if self.merge:
                logits = keys[head].float() @ mean_query[head] * scaling
                mergeable = torch.isfinite(votes[head].log()) & ~kept[head]
                mergeable[max(0, tokens - self.recent_tokens) :] = False
                k, v, p = merge_into_kept(keys[head], values[head], votes[head], logits, kept[head], mergeable)
            else:
                k, v, p = keys[head][kept[head]], values[head][kept[head]], votes[head][kept[head]]
            parts["k"].append(k)
            parts["v"].append(v)
            parts["votes"].append(p)
            parts["index"].append(kept[head].nonzero()[:, 0].to(torch.int16 if tokens < 2**15 else torch.int32))
        stored = {name: torch.cat(rows) for name, rows in parts.items()}
        stored["counts"] = torch.tensor([len(rows) for rows in parts["index"]], dtype=torch.int32)
        if heads * -(-tokens // 8) < stored["index"].nbytes:
            stored["kept"] = pack_mask(kept)
            del stored["index"]
        stored["votes"] = stored["votes"].round().to(torch.int32)
        if bool((stored["votes"] == 1).all()):
            del stored["votes"]  # plain eviction: nothing to store
        return stored


def padded_bias(bias: torch.Tensor, tokens: int) -> torch.Tensor:
    """A restored state's bias covers the history it was restored with; later tokens are unbiased."""
    if bias.shape[1] >= tokens:
        return bias[:, :tokens]
    return torch.cat([bias, bias.new_zeros(bias.shape[0], tokens - bias.shape[1])], dim=1)


def kept_rows(stored: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(head, position) of each stored row of one layer, in the rows' order, from its "counts" and either
    "kept" bits or "index" numbers; ValueError where the two do not agree."""
    counts = stored["counts"].long()
    if "kept" not in stored:
        return _head_of_rows(counts), stored["index"].long()
    bits = unpack_mask(stored["kept"])
    if bits.dim() != 2 or len(bits) != len(counts) or not torch.equal(bits.sum(dim=1), counts):
        raise ValueError("kept bits do not match the counts per head")
    heads, positions = bits.nonzero(as_tuple=True)
    return heads, positions


def check_votes(votes: torch.Tensor | None, rows: int) -> None:
    """ValueError unless a merge's stored votes are a whole count of at least one per kept row (their logs are
    the attention bias: a vote below one would be -inf or NaN)."""
    if votes is None:
        return
    if votes.dim() != 1 or len(votes) != rows or votes.is_floating_point() or bool((votes < 1).any()):
        raise ValueError("merge votes are not a count of at least one per kept row")


def bias_of(stored: dict[str, torch.Tensor], heads: int, tokens: int) -> torch.Tensor:
    bias = torch.full((heads, tokens), -torch.inf)
    votes = stored.get("votes")
    rows_head, rows_token = kept_rows(stored)
    check_votes(votes, len(rows_token))
    values = torch.zeros(len(rows_token)) if votes is None else votes.float().log()
    if bool((rows_token >= tokens).any()):
        raise ValueError("kept rows do not fit their positions")
    bias[rows_head, rows_token] = values
    return bias


def _head_of_rows(counts: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(counts)), counts.long())


def restore_layers(tensors: dict[str, torch.Tensor], tokens: int, num_layers: int) -> Layers:
    """Dense [Hkv, T, d] layers from the ragged stored form (evicted entries are zeros, masked by the bias)."""
    layers = []
    for index in range(num_layers):
        k, v, counts = tensors[f"{index}.k"], tensors[f"{index}.v"], tensors[f"{index}.counts"]
        keys = torch.zeros(len(counts), tokens, k.shape[-1], dtype=k.dtype)
        values = torch.zeros(len(counts), tokens, v.shape[-1], dtype=v.dtype)
        scatter_layer(tensors, index, keys, values)
        layers.append((keys, values))
    return layers


def scatter_layer(tensors: dict[str, torch.Tensor], index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Writes layer `index`'s kept rows into zeroed dense [Hkv, T, d] `keys` / `values` (a restore's own
    tensors, or a reserved cache's rows: statekeeper/restore_pipeline.py restores layer by layer)."""
    k, v, counts = tensors[f"{index}.k"], tensors[f"{index}.v"], tensors[f"{index}.counts"]
    rows_head, rows_token = kept_rows(_layer_rows(tensors, index))
    if not len(rows_token) == len(k) == len(v) == int(counts.long().sum()) or len(counts) != keys.shape[0] or bool(
            ((rows_token < 0) | (rows_token >= keys.shape[1])).any()):
        raise ValueError(f"layer {index}: kept rows do not fit their positions")
    rows_head, rows_token = rows_head.to(keys.device), rows_token.to(keys.device)
    keys[rows_head, rows_token] = k.to(keys.device, keys.dtype)
    values[rows_head, rows_token] = v.to(values.device, values.dtype)


def _layer_rows(tensors: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Layer `index`'s row bookkeeping (positions, counts, votes) under their own names."""
    return {name: tensors[f"{index}.{name}"] for name in ("index", "kept", "counts", "votes")
            if f"{index}.{name}" in tensors}


def live_bias(tensors: dict[str, torch.Tensor], tokens: int, num_layers: int) -> list[torch.Tensor] | None:
    """The attention bias of a blob's wider live selection ("i.live", HeadBudgetEviction.live_keep: 0 where
    attended, -inf elsewhere), for a restore that reads those entries' rows from the exact copy; None for a
    blob without one. ValueError when the positions do not fit the layer."""
    if "0.live" not in tensors:
        return None
    biases = []
    for index in range(num_layers):
        heads = len(tensors[f"{index}.counts"])
        live = unpack_mask(tensors[f"{index}.live"])
        if live.shape[0] != heads or live.shape[1] < tokens:
            raise ValueError("live positions do not fit their layer")
        bias = torch.full((heads, tokens), -torch.inf)
        bias[live[:, :tokens]] = 0.0
        biases.append(bias)
    return biases


def restore_bias(tensors: dict[str, torch.Tensor], tokens: int, num_layers: int) -> list[torch.Tensor]:
    return [bias_of(_layer_rows(tensors, i), len(tensors[f"{i}.counts"]), tokens) for i in range(num_layers)]
