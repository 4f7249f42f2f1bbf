"""Cross-layer merge of one tensor pair (MiniCache's formulation, which Krul §6.1 uses): per token and
head, the unit directions of the two layers' vectors are interpolated with SLERP, each layer keeps its
own magnitude, and tokens whose directions are too far apart stay unmerged in both layers.
Stored compactly: one direction and two norms per merged row, both vectors per retained row, and the
retained mask. Torch reference; a fused CUDA version would sit beside it and be tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_PARTS = ("retained", "direction", "norm_a", "norm_b", "original_a", "original_b")


@dataclass(slots=True)
class MergedPair:
    retained: torch.Tensor  # [H, T] bool: rows kept unmerged
    direction: torch.Tensor  # [M, D] shared unit direction of the merged rows, in mask order
    norm_a: torch.Tensor  # [M]
    norm_b: torch.Tensor  # [M]
    original_a: torch.Tensor  # [R, D] the retained rows of a
    original_b: torch.Tensor  # [R, D]

    @property
    def stored_bytes(self) -> int:
        return sum(getattr(self, part).nbytes for part in _PARTS)

    def tensors(self, prefix: str) -> list[tuple[str, torch.Tensor]]:
        return [(f"{prefix}.{part}", getattr(self, part)) for part in _PARTS]

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> "MergedPair":
        return cls(*(tensors[f"{prefix}.{part}"] for part in _PARTS))


def slerp_merge(a: torch.Tensor, b: torch.Tensor, t: float = 0.5, retain_angle: float = 0.5) -> MergedPair:
    """`a`, `b`: [H, T, D]. `retain_angle`: rows whose angle exceeds this fraction of pi stay unmerged."""
    x, y = a.float(), b.float()
    norm_a, norm_b = x.norm(dim=-1), y.norm(dim=-1)
    unit_a = x / norm_a.clamp_min(1e-12)[..., None]
    unit_b = y / norm_b.clamp_min(1e-12)[..., None]
    theta = torch.arccos((unit_a * unit_b).sum(-1).clamp(-1.0, 1.0))
    sin = torch.sin(theta).clamp_min(1e-6)[..., None]
    slerp = (torch.sin((1 - t) * theta)[..., None] * unit_a + torch.sin(t * theta)[..., None] * unit_b) / sin
    direction = torch.where((theta < 1e-4)[..., None], (1 - t) * unit_a + t * unit_b, slerp)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    retained = theta > retain_angle * torch.pi
    merged = ~retained
    return MergedPair(retained, direction[merged].to(a.dtype), norm_a[merged].to(a.dtype), norm_b[merged].to(a.dtype),
                      a[retained].clone(), b[retained].clone())


def unmerge(pair: MergedPair) -> tuple[torch.Tensor, torch.Tensor]:
    heads, tokens = pair.retained.shape
    dim = pair.direction.shape[-1] if pair.direction.numel() else pair.original_a.shape[-1]
    dtype = pair.direction.dtype
    a = torch.empty(heads, tokens, dim, dtype=dtype)
    b = torch.empty(heads, tokens, dim, dtype=dtype)
    merged = ~pair.retained
    a[merged] = pair.direction * pair.norm_a[:, None]
    b[merged] = pair.direction * pair.norm_b[:, None]
    a[pair.retained] = pair.original_a
    b[pair.retained] = pair.original_b
    return a, b
