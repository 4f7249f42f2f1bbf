"""Int8 linear layers with dynamically quantized activations (PyTorch's quantized CPU engine: fbgemm /
x86 / onednn), next to the fp32 reference they replace: weights int8, one symmetric scale per output
channel, packed once; each call quantizes its input to 8 bits with one scale per call and accumulates
in int32. About 1.8-1.9x faster than fp32 on an AVX2 core for SmolLM2's shapes (128-512 rows).

It changes outputs (~1% relative error), so it is only for forwards whose result is a ranking, never
the live model: KVzip's scoring forward (statekeeper/compression/reconstruction.py)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@dataclass(slots=True)
class Int8Linear:
    packed: object  # the engine's packed weight
    in_features: int
    out_features: int
    reduce_range: bool  # 7-bit activations where the engine's AVX2 kernel would overflow int16 otherwise

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError("Int8Linear needs a 2-d CPU weight")
        weight = weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).double()
        zeros = torch.zeros(weight.shape[0], dtype=torch.long)
        with warnings.catch_warnings():  # torch.ao's deprecation notices: the ops themselves are current
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())
        engine = torch.backends.quantized.engine
        return cls(packed, weight.shape[1], weight.shape[0], engine in ("fbgemm", "x86"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"Int8Linear takes float32 CPU inputs of {self.in_features} features, "
                             f"not {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.quantized.linear_dynamic(rows.contiguous(), self.packed, self.reduce_range)
        return out.reshape(*x.shape[:-1], self.out_features)


def int8_versions(modules: list[torch.nn.Linear]) -> dict[torch.nn.Linear, Int8Linear]:
    """Packed int8 copies of fp32 CPU linears (others are left out)."""
    return {module: Int8Linear.from_weight(module.weight, module.bias) for module in modules
            if module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"}


@contextmanager
def swapped_linears(versions: dict[torch.nn.Linear, Int8Linear]):
    """Inside this block each linear in `versions` computes with its int8 version (an instance `forward`
    shadowing the class's); afterwards every one is back to its own forward, also on an exception."""
    swapped = []
    try:
        for module, int8 in versions.items():
            module.forward = int8
            swapped.append(module)
        yield
    finally:
        for module in swapped:
            del module.forward
