"""Integer codec for a stored state's tensors (kernels/quant.py), applied after any other compression.

Order: cross-layer sharing (or eviction) decides *what* is stored, on full-precision vectors (SLERP
needs exact directions); the codec then decides *how* each stored vector is written. Only K and V
rows are quantized (".k", ".v", merged directions and retained rows, by name); norms, masks, indices
and votes stay as they are. A quantized tensor `name` is stored
as `name.codes`, `name.scale`, `name.zero`, described in the blob meta under "quant", and dequantized
on restore before the rest of the restore path sees it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.quant import Quantized, dequantize, quantize

Named = list[tuple[str, torch.Tensor]]
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_VECTORS = (".k", ".v", ".direction", ".original_a", ".original_b")  # rows of head_dim elements


@dataclass(slots=True)
class IntCodec:
    bits: int = 8
    group_size: int = 64  # elements per scale and zero point, along the head dimension (one token's vector)

    def encode(self, tensors: Named, head_dim: int) -> tuple[Named, dict]:
        out, described = [], {}
        for name, tensor in tensors:
            if not name.endswith(_VECTORS) or tensor.shape[-1] != head_dim or not tensor.numel():
                out.append((name, tensor))
                continue
            q = quantize(tensor, self.bits, -1, math.gcd(self.group_size, head_dim))
            out += [(f"{name}.codes", q.codes), (f"{name}.scale", q.scale), (f"{name}.zero", q.zero)]
            described[name] = {"bits": q.bits, "shape": list(q.shape), "group_size": q.group_size,
                               "dtype": str(tensor.dtype).removeprefix("torch.")}
        return out, {"codec": f"int{self.bits}", "group_size": self.group_size, "tensors": described}


def decode(tensors: dict[str, torch.Tensor], quant: dict) -> dict[str, torch.Tensor]:
    """Replaces each quantized tensor's parts with the dequantized tensor; raises KeyError/ValueError on
    a blob whose description does not fit its tensors."""
    result = dict(tensors)
    for name, info in quant["tensors"].items():
        parts = [result.pop(f"{name}.{part}") for part in ("codes", "scale", "zero")]
        shape = tuple(info["shape"])
        q = Quantized(*parts, int(info["bits"]), shape, len(shape) - 1, int(info["group_size"]), _DTYPES[info["dtype"]])
        result[name] = dequantize(q)
    return result


def by_name(codec: str, group_size: int = 64) -> IntCodec | None:
    if codec == "none":
        return None
    if codec in ("int8", "int4"):
        return IntCodec(int(codec[3:]), group_size)
    raise ValueError(f"unknown codec {codec!r}")
