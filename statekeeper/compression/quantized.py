"""Integer quantization of stored K and V (kernels/quant.py): keys grouped along channels per token
and values along tokens per channel by default (KIVI's finding that key outliers live in channels)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kernels.quant import dequantize, quantize
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers


@dataclass(slots=True)
class QuantizedKV:
    bits: int = 8
    group_size: int = 64
    key_dim: int = -1  # -1: groups of channels within a token; 1: groups of tokens within a channel
    value_dim: int = -1

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    def compress(self, layers: Layers, stats: AttentionStats | None = None) -> Compressed:
        restored, stored = [], 0
        for keys, values in layers:
            pair = []
            for tensor, dim in ((keys, self.key_dim), (values, self.value_dim)):
                # The largest group that divides the axis (a token count is rarely a multiple of 64).
                group = math.gcd(self.group_size, tensor.shape[dim])
                q = quantize(tensor, self.bits, dim, group)
                stored += q.nbytes
                pair.append(dequantize(q))
            restored.append((pair[0], pair[1]))
        return Compressed(restored, stored)
