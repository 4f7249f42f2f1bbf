"""Integer quantization with per-group scales and zero points (torch reference).

A tensor is split into groups of `group_size` consecutive elements along `dim`; each group stores
uint8 codes (packed: two 4-bit codes per byte, four 2-bit codes, eight 3-bit codes in three bytes), an
fp16 scale and an fp16 zero point:
    x ≈ code * scale + zero,  scale = (max - min) / (2^bits - 1),  zero = min
(below 4 bits the range is clipped where that lowers the group's squared error, `_clipped_range`).
`symmetric` groups span [-max|x|, max|x|] instead, so the zero point is -scale * (2^bits - 1) / 2 and is
not stored: 2 bytes less per group, for rows that are near zero-mean anyway (Hadamard-rotated ones).
Keys may want groups along channels and values along tokens (KIVI-style); the caller picks `dim`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(slots=True)
class Quantized:
    codes: torch.Tensor  # uint8, packed below 8 bits (see `pack`)
    scale: torch.Tensor  # float16, one per group
    zero: torch.Tensor | None  # float16, one per group; None: symmetric (derived from the scale)
    bits: int
    shape: tuple[int, ...]
    dim: int
    group_size: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (0 if self.zero is None else self.zero.nbytes)


def _grouped(x: torch.Tensor, dim: int, group_size: int) -> torch.Tensor:
    moved = x.movedim(dim, -1)
    if moved.shape[-1] % group_size:
        raise ValueError(f"size {moved.shape[-1]} along dim {dim} is not a multiple of group size {group_size}")
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // group_size, group_size)


BITS = (2, 3, 4, 8)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes < 2^bits, flat, packed: 8 bits one per byte, 4 bits two per byte, 2 bits four per byte,
    3 bits eight codes in three bytes (the code count padded with zeros to a whole pack)."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    per_pack = 8 if bits == 3 else 8 // bits
    flat = torch.cat([flat, flat.new_zeros(-len(flat) % per_pack)]).reshape(-1, per_pack).int()
    shifts = torch.arange(per_pack, dtype=torch.int32, device=flat.device) * bits
    words = (flat << shifts).sum(dim=1, dtype=torch.int32)  # per_pack * bits <= 24 bits
    num_bytes = per_pack * bits // 8
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(num_bytes)], dim=1).to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` codes of `pack`'s output, as uint8."""
    if bits == 8:
        return packed[:count]
    per_pack = 8 if bits == 3 else 8 // bits
    num_bytes = per_pack * bits // 8
    chunks = packed.reshape(-1, num_bytes).int()
    words = sum(chunks[:, i] << (8 * i) for i in range(num_bytes))
    shifts = torch.arange(per_pack, dtype=torch.int32, device=packed.device) * bits
    return ((words[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(-1)[:count]


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor's last axis as bits, eight per uint8 (first element in the lowest bit, the last byte
    padded with zeros): [..., n] -> [..., ceil(n / 8)]."""
    padded = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], -mask.shape[-1] % 8)], dim=-1)
    bits = padded.reshape(*mask.shape[:-1], -1, 8).to(torch.uint8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=mask.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor) -> torch.Tensor:
    """`pack_mask`'s bits back as bools, padding included: [..., m] uint8 -> [..., 8 m]."""
    bits = (packed[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1
    return bits.reshape(*packed.shape[:-1], -1).bool()


_BITS_SET = torch.tensor([bin(byte).count("1") for byte in range(256)], dtype=torch.uint8)


def mask_count(packed: torch.Tensor) -> torch.Tensor:
    """The bits set in `pack_mask`'s output along its last axis, read a byte at a time (a host check of
    a blob's masks without unpacking them: 8x fewer elements): [..., m] uint8 -> [...] int64."""
    return _BITS_SET.to(packed.device)[packed.long()].sum(dim=-1)


def mask_set_past(packed: torch.Tensor, length: int) -> bool:
    """Whether any of `pack_mask`'s output marks an element at `length` or past it (padding is zero)."""
    whole, rest = divmod(length, 8)
    if rest and whole < packed.shape[-1] and bool((packed[..., whole] >> rest).any()):
        return True
    return bool(packed[..., whole + bool(rest):].any())


def quantize(x: torch.Tensor, bits: int = 8, dim: int = -1, group_size: int = 64,
             symmetric: bool = False) -> Quantized:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}")
    dim = dim % x.dim()
    groups = _grouped(x.float(), dim, group_size)
    if symmetric:  # clipping below keeps the range centred on zero
        high = groups.abs().amax(dim=-1, keepdim=True)
        low = -high
    else:
        low = groups.amin(dim=-1, keepdim=True)
        high = groups.amax(dim=-1, keepdim=True)
    levels = (1 << bits) - 1
    if bits < 4:
        low, high = _clipped_range(groups, low, high, levels)
    scale = ((high - low) / levels).clamp_min(1e-8)
    codes = torch.round((groups - low) / scale).clamp_(0, levels).to(torch.uint8)
    if bits == 4:  # the layout int4 blobs were written with: low nibble first
        flat = codes.reshape(-1, 2)
        codes = flat[:, 0] | (flat[:, 1] << 4)
    elif bits != 8:
        codes = pack(codes, bits)
    return Quantized(codes, scale.half(), None if symmetric else low.half(), bits, tuple(x.shape), dim, group_size,
                     x.dtype)


CLIP_RATIOS = (0.9, 0.8, 0.7, 0.6, 0.5)


def _clipped_range(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor, levels: int):
    """Per group, the range (shrunk about its middle by one of CLIP_RATIOS, or not) with the least squared
    error: with 4 or 8 levels a min-max range spends them on the group's extremes (for Gaussian-like rows
    the best uniform 2-bit quantizer clips near 1.5 sigma where a group of 64 reaches ~2.4)."""

    def error(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        scale = ((hi - lo) / levels).clamp_min(1e-8)
        codes = torch.round((groups - lo) / scale).clamp_(0, levels)
        return (codes * scale + lo - groups).square().sum(dim=-1, keepdim=True)

    best_low, best_high, best_error = low, high, error(low, high)
    middle, half = (high + low) / 2, (high - low) / 2
    for ratio in CLIP_RATIOS:
        lo, hi = middle - ratio * half, middle + ratio * half
        candidate = error(lo, hi)
        better = candidate < best_error
        best_low, best_high = torch.where(better, lo, best_low), torch.where(better, hi, best_high)
        best_error = torch.minimum(candidate, best_error)
    return best_low, best_high


def dequantize(q: Quantized) -> torch.Tensor:
    codes = q.codes
    if q.bits == 4:
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=-1)
    elif q.bits != 8:
        codes = unpack(codes, q.bits, math.prod(q.shape))
    moved_shape = list(q.shape)
    moved_shape.append(moved_shape.pop(q.dim))
    groups = codes.reshape(*moved_shape[:-1], moved_shape[-1] // q.group_size, q.group_size).float()
    scale = q.scale.float()
    zero = -scale * ((1 << q.bits) - 1) / 2 if q.zero is None else q.zero.float()
    values = groups * scale + zero
    return values.reshape(moved_shape).movedim(-1, q.dim).to(q.dtype)


@lru_cache(maxsize=8)
def rotation(dim: int, seed: int = 0, device: torch.device | None = None) -> torch.Tensor:
    """An orthonormal randomized Hadamard matrix R = diag(signs) · H / sqrt(dim), dim a power of two.
    Rotating each head_dim row by R before quantizing spreads a few outlier channels over all of them,
    so a per-token group's range shrinks (QuaRot / QuIP#); x = (x R) Rᵀ restores the row exactly.
    Built once per (dim, seed, device) and shared: callers must not modify it. A GPU's copy is made once,
    outside any restore (copying from pageable memory makes the host wait for the stream)."""
    if device is not None and torch.device(device).type != "cpu":
        return rotation(dim, seed).to(device)
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"rotation needs a power-of-two size, not {dim}")
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < dim:  # Sylvester's construction
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed)) * 2 - 1
    return signs[:, None].float() * hadamard / dim**0.5
