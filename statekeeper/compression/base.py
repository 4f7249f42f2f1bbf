"""The compression interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, tokens, head_dim]


@dataclass(slots=True)
class Compressed:
    layers: Layers  # what the model attends to after a restore
    stored_bytes: int  # what the stored form costs


class KVCompressor(Protocol):
    name: str

    def compress(self, layers: Layers) -> Compressed: ...


@dataclass(slots=True)
class NoCompression:
    name: str = "none"

    def compress(self, layers: Layers) -> Compressed:
        return Compressed(layers, sum(k.nbytes + v.nbytes for k, v in layers))
