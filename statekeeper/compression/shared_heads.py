"""Cross-layer sharing composed with per-head eviction (issue 5's comparison "with and without sharing").

Order: the sharing method picks its layer pairs (compression/sharing.py); every layer is scored by the
eviction's scorer; the two layers of a pair keep one token set per head, selected on the larger of their
two scores (a token either layer needs stays) with the eviction's budget rule and, for calibrated
budgets, the larger of the two heads' budgets; unpaired layers are evicted as by the eviction alone.
Then each pair's kept rows of the shared part (values by default) are merged across the two layers (SLERP
with a norm per layer, MiniCache / Krul §6.1, kernels/slerp.py), so the pair stores one direction per
kept row where the eviction alone stores two rows. The positions are stored once per pair. A codec, if
any, applies after this (compression/__init__.py WithCodec).

Sharing needs both layers to keep the same tokens, which costs the eviction some freedom: that trade
is what benchmarks/fidelity.py measures (`<sharing>/<eviction>` names, e.g. `damage/kvzip@0.5`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kernels.slerp import MergedPair, slerp_merge, unmerge
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers
from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_budget import HeadBudgetEviction, bias_of, padded_bias, restore_bias, restore_layers
from statekeeper.compression.registry import register
from statekeeper.compression.sharing import CrossLayerSharing


@register
@dataclass(slots=True)
class SharedHeadEviction:
    """`<sharing method>/<per-head method>` by name (compression/__init__.py composes the two)."""

    name: str
    sharing: CrossLayerSharing
    eviction: HeadBudgetEviction
    spec_names: ClassVar = ()
    policies: ClassVar = ()
    form: ClassVar = "shared_heads"

    @classmethod
    def compose(cls, name: str, share, evict) -> SharedHeadEviction:
        if not isinstance(share, CrossLayerSharing) or not isinstance(evict, HeadBudgetEviction):
            raise ValueError(f"{name!r}: expected <sharing method>/<per-head method>")
        return cls(name, share, evict)

    @staticmethod
    def restore(tensors: dict[str, torch.Tensor], form: StoredForm, num_layers: int) -> tuple[Layers, list]:
        tensors = unshare(tensors, form.pairs, form.parts)
        return restore_layers(tensors, form.num_tokens, num_layers), restore_bias(tensors, form.num_tokens, num_layers)

    @property
    def scorer(self) -> str:
        return self.eviction.scorer

    def compress(self, layers: Layers, stats: AttentionStats | None = None,
                 bias: list[torch.Tensor] | None = None) -> Compressed:
        pairs = self.sharing.select(stats, len(layers))
        parts = [part for part, on in (("k", self.sharing.share_keys), ("v", self.sharing.share_values)) if on]
        tokens = layers[0][0].shape[1]
        biases = [None if bias is None else padded_bias(bias[i], tokens) for i in range(len(layers))]
        kept = self._kept(layers, stats, biases, pairs)
        queries = [self.eviction.recent_queries(stats, i) if self.eviction.merge else None for i in range(len(layers))]
        stored = [self.eviction.store(k, v, queries[i], kept[i], biases[i]) for i, (k, v) in enumerate(layers)]
        head_bias = [bias_of(rows, k.shape[0], tokens) for rows, (k, _) in zip(stored, layers)]
        tensors = {f"{i}.{name}": tensor for i, rows in enumerate(stored) for name, tensor in rows.items()}
        for i, j in pairs:
            for name in ("index", "kept", "counts"):
                tensors.pop(f"{j}.{name}", None)
            for part in parts:
                a, b = tensors.pop(f"{i}.{part}"), tensors.pop(f"{j}.{part}")
                merged = slerp_merge(a[None], b[None], self.sharing.t, self.sharing.retain_angle)
                tensors.update(merged.tensors(f"{i}+{j}.{part}"))
        form = StoredForm("shared_heads", self.name, num_tokens=tokens, pairs=tuple(tuple(p) for p in pairs),
                          parts=tuple(parts))
        named = list(tensors.items())

        def rebuild() -> Layers:
            return restore_layers(unshare(tensors, form.pairs, form.parts), tokens, len(layers))

        return Compressed(rebuild(), sum(t.nbytes for t in tensors.values()), form=form, tensors=named,
                          rebuild=rebuild, head_bias=head_bias)

    def _kept(self, layers: Layers, stats, biases: list, pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
        """[Hkv, T] bool per layer; both layers of a pair get the same set."""
        scores = [self.eviction.scores(i, k, v, stats, biases[i]) for i, (k, v) in enumerate(layers)]
        profile = self.eviction.profile
        kept: list[torch.Tensor | None] = [None] * len(layers)
        for i, j in pairs:
            both = None if biases[i] is None else torch.minimum(biases[i], biases[j])
            budgets = None if profile is None else [max(a, b) for a, b in zip(profile[i], profile[j])]
            kept[i] = kept[j] = self.eviction.select(torch.maximum(scores[i], scores[j]), both, budgets)
        return [self.eviction.select(scores[i], biases[i], None if profile is None else profile[i])
                if chosen is None else chosen for i, chosen in enumerate(kept)]


def unshare(tensors: dict[str, torch.Tensor], pairs, parts) -> dict[str, torch.Tensor]:
    """The per-layer ragged tensors of head_budget's layout, from a pair-merged stored form."""
    result = dict(tensors)
    for i, j in pairs:
        for name in ("index", "kept", "counts"):
            if f"{i}.{name}" in result:
                result[f"{j}.{name}"] = result[f"{i}.{name}"]
        for part in parts:
            a, b = unmerge(MergedPair.from_tensors(result, f"{i}+{j}.{part}"))
            result[f"{i}.{part}"], result[f"{j}.{part}"] = a[0], b[0]
    return result
