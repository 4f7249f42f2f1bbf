"""The compression interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from statekeeper.compression.attention_stats import AttentionStats

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, tokens, head_dim]


def layers_nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


@dataclass(slots=True)
class Compressed:
    layers: Layers  # what the model attends to after a restore
    stored_bytes: int  # what the stored form costs
    keep: torch.Tensor | None = None  # [tokens] bool: history tokens still attended (eviction methods)
    detail: dict = field(default_factory=dict)  # e.g. the shared layer pairs; stored as blob meta
    tensors: list | None = None  # the stored form as named tensors, where it differs from `layers`
    rebuild: Callable[[], Layers] | None = None  # stored form -> attended layers (what a restore runs)
    head_bias: list[torch.Tensor] | None = None  # per layer [kv_heads, tokens] (per-head eviction, merged votes)
    # Per stored tensor name, the method's score of each of its rows (not stored): per-head eviction's
    # scores of the entries it kept, which a codec may use to write the top-scored rows more precisely.
    row_scores: dict[str, torch.Tensor] | None = None

    def restore(self) -> Layers:
        return self.rebuild() if self.rebuild is not None else self.layers


class KVCompressor(Protocol):
    name: str

    def compress(self, layers: Layers, stats: AttentionStats | None = None,
                 bias: list[torch.Tensor] | None = None) -> Compressed:
        """`bias`: the per-head attention bias already in effect on these layers (a state restored from
        per-head eviction); a method that cannot carry it forward raises ValueError."""
        ...


@dataclass(slots=True)
class NoCompression:
    name: str = "none"

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias=None) -> Compressed:
        refuse_bias(self.name, bias)
        return Compressed(layers, layers_nbytes(layers))


def refuse_bias(name: str, bias) -> None:
    if bias is not None:
        raise ValueError(f"{name} cannot keep a per-head attention bias")
