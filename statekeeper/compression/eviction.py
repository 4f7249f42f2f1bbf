"""H2O-style eviction baseline: the tokens that received the least attention (summed over layers and
sampled queries) stop being attended, except the first tokens and a recent window. The same tokens are
dropped in every layer, so the effect is a mask over history positions; `keep_fraction` is set from the
byte budget of the method it is compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers, layers_nbytes, refuse_bias
from statekeeper.compression.registry import MethodSpec, register


@register
@dataclass(slots=True)
class H2OEviction:
    """An evaluation baseline (statekeeper/evaluation/): its mask is what is measured; what it would store
    is the exact form, restored as such."""

    keep_fraction: float = 0.8
    sink_tokens: int = 4
    recent_tokens: int = 64
    name: str = "h2o"
    spec_names: ClassVar = ("h2o",)
    policies: ClassVar = ()
    form: ClassVar = "exact"

    @classmethod
    def from_spec(cls, spec: MethodSpec) -> H2OEviction:
        return cls()

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias=None) -> Compressed:
        refuse_bias(self.name, bias)
        if stats is None:
            raise ValueError("h2o needs attention statistics")
        num_tokens = layers[0][0].shape[1]
        scores = stats.key_scores[:, :num_tokens].sum(0).clone()
        scores[: self.sink_tokens] = float("inf")
        scores[max(0, num_tokens - self.recent_tokens) :] = float("inf")
        budget = max(1, round(self.keep_fraction * num_tokens))
        keep = torch.zeros(num_tokens, dtype=torch.bool)
        keep[torch.topk(scores, min(budget, num_tokens)).indices] = True
        stored = round(layers_nbytes(layers) * int(keep.sum()) / num_tokens)
        return Compressed(layers, stored, keep=keep)
