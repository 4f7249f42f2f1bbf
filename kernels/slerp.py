"""Cross-layer merge of one tensor pair (MiniCache's formulation, which Krul §6.1 uses): per token and
head, the unit directions of the two layers' vectors are interpolated with SLERP, each layer keeps its
own magnitude, and tokens whose directions are too far apart stay unmerged in both layers.
Torch reference; a fused CUDA version would sit beside it and be tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class MergedPair:
    direction: torch.Tensor  # [H, T, D] shared unit direction (meaningless where retained)
    norm_a: torch.Tensor  # [H, T]
    norm_b: torch.Tensor  # [H, T]
    retained: torch.Tensor  # [H, T] bool: kept unmerged
    original_a: torch.Tensor  # [R, D] the retained rows of a, in mask order
    original_b: torch.Tensor  # [R, D]

    def stored_bytes(self, itemsize: int) -> int:
        """Merged rows store one direction and two norms; retained rows both vectors, plus their index."""
        heads, tokens, dim = self.direction.shape
        merged = int((~self.retained).sum())
        retained = int(self.retained.sum())
        return merged * (dim + 2) * itemsize + retained * (2 * dim * itemsize + 4)


def slerp_merge(a: torch.Tensor, b: torch.Tensor, t: float = 0.5, retain_angle: float = 0.5) -> MergedPair:
    """`a`, `b`: [H, T, D]. `retain_angle`: tokens whose angle exceeds this fraction of pi stay unmerged."""
    x, y = a.float(), b.float()
    norm_a, norm_b = x.norm(dim=-1), y.norm(dim=-1)
    unit_a = x / norm_a.clamp_min(1e-12)[..., None]
    unit_b = y / norm_b.clamp_min(1e-12)[..., None]
    cos = (unit_a * unit_b).sum(-1).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    sin = torch.sin(theta).clamp_min(1e-6)[..., None]
    slerp = (torch.sin((1 - t) * theta)[..., None] * unit_a + torch.sin(t * theta)[..., None] * unit_b) / sin
    nearly_parallel = (theta < 1e-4)[..., None]
    direction = torch.where(nearly_parallel, (1 - t) * unit_a + t * unit_b, slerp)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    retained = theta > retain_angle * torch.pi
    return MergedPair(direction.to(a.dtype), norm_a.to(a.dtype), norm_b.to(a.dtype), retained, a[retained], b[retained])


def unmerge(pair: MergedPair) -> tuple[torch.Tensor, torch.Tensor]:
    a = pair.direction * pair.norm_a[..., None]
    b = pair.direction * pair.norm_b[..., None]
    a[pair.retained] = pair.original_a
    b[pair.retained] = pair.original_b
    return a, b
