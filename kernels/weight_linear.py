"""Linear layers with quantized weights for the live model (the WEIGHT_PRECISION setting), each beside the
plain torch function it must match: `reference_weight` is the float32 weight a layer computes with, so
`F.linear(x, reference_weight(...))` is the reference for each.

Decode on a CPU streams every weight from memory once per token, so fewer bytes per weight is most of
the speed. The kernels:
- `DynamicInt8Linear`: int8 weights with one scale per output channel, and each call's input quantized
  to 8 bits with one scale (PyTorch's quantized engine, fbgemm/onednn: VNNI int8 dot products, int32
  accumulation). Fast at every row count, decode and prefill; the input's rounding is its error.
- `Int8WeightLinear`: int8 weights, one scale per output channel, bfloat16 activations
  (`aten._weight_int8pack_mm`).
- `Int4WeightLinear`: 4-bit weights in groups along the input with a scale and a zero each, bfloat16
  activations (`aten._weight_int4pack_mm_for_cpu`, tinygemm's layout: w = (q - 8) * scale + zero).
The weight-only kernels are fast for a few rows only, and with bfloat16 activations only (their float32
paths are not vectorized on x86: 4-10x slower than an fp32 GEMM); many rows go through a GEMM over the same
dequantized weights (`WeightOnlyLinear`): bfloat16 where the CPU has it (AMX, AVX-512 BF16), float32 where
bfloat16 is emulated, as measured at start. BENCHMARKS.md, issues 17 and 30, has the measurements."""

from __future__ import annotations

import torch

from kernels.bf16_gemm import Bf16Gemm, packing_available
from kernels.fp32_gemm import Fp32Gemm
from kernels.int8_linear import Int8Linear

INT4_GROUP_SIZES = (32, 64, 128, 256)  # the ones aten's int4 CPU kernel takes
# From this many rows the weight-only layers use a GEMM over their dequantized weights (default_gemm), until
# the machine's own crossover and GEMM are measured (statekeeper/dense_rows_choice.py): bfloat16 from 12 rows
# with AMX, from 48 with oneDNN's AVX-512 BF16 kernels (BENCHMARKS.md, issue 31), float32 from 16 where
# bfloat16 is emulated (issue 30).
DENSE_FROM_ROWS = 16
GEMMS = {gemm.dtype: gemm for gemm in (Bf16Gemm, Fp32Gemm)}  # the many-row paths, by the dtype they compute in


def default_gemm() -> str:
    """The GEMM a layer starts with, until the machine's own is measured: bfloat16 where oneDNN has native
    bfloat16 kernels (AVX-512 BF16, AMX), else float32 (an emulated bfloat16 GEMM is 2.6x slower than the
    quantized kernel on an AVX2 AMD EPYC, the float32 one faster from 16 rows: BENCHMARKS.md, issue 30). The
    float32 copies take the bytes the float32 layers took before they were quantized, which loading held."""
    return "bfloat16" if packing_available() else "float32"


class QuantizedLinear(torch.nn.Module):
    """Shared shape checks: float32 CPU inputs of `in_features`, float32 outputs like nn.Linear's."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features or x.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} takes float32 CPU inputs of {self.in_features} features, "
                             f"not {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = self._matmul(x.reshape(-1, self.in_features).contiguous())
        return rows.reshape(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        return sum(buffer.nbytes for name, buffer in self.named_buffers() if name != "bias")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes in [-127, 127] and one float32 scale per output channel (row)."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes in [0, 15] (int32, [out, in]) with a scale and a zero per group of
    `group_size` inputs ([out, in / group_size] each), such that w ≈ (code - 8) * scale + zero."""
    out_features, in_features = weight.shape
    groups = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32)
    return codes.reshape(out_features, in_features), scales, low + 8 * scales


class DynamicInt8Linear(QuantizedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.kernel = Int8Linear.from_weight(weight, self.bias)  # the engine's packed copy (opaque)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.kernel(rows)  # the bias is inside the packed weight

    @property
    def weight_bytes(self) -> int:  # what the kernel reads: its packed int8 copy and one scale per row
        return self.out_features * (self.in_features + 8)


class WeightOnlyLinear(QuantizedLinear):
    """Few rows (decode): the quantized kernel, which reads 1 or 0.5 bytes a weight. Many rows (a prefill
    chunk, a big batch): a GEMM over the same quantized weights dequantized once, where the kernel is 4-10x
    slower than a dense GEMM: bfloat16 (AMX / AVX512-BF16; 2 bytes a weight of memory) or float32 (4 bytes a
    weight; where bfloat16 is emulated), `default_gemm` until `use_gemm` says which."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, reference: torch.Tensor):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.dense = GEMMS[default_gemm()](reference)  # not a buffer: rebuilt from the codes on load
        self.dense_from_rows = DENSE_FROM_ROWS

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.few_rows(rows) if rows.shape[0] < self.dense_from_rows else self.dense(rows)
        return out if self.bias is None else out + self.bias

    def few_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The quantized kernel's product, without the bias: what fewer than `dense_from_rows` rows get."""
        return self._kernel(rows.to(torch.bfloat16)).float()

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def use_gemm(self, dtype: str) -> None:
        """The many-row path as the GEMM computing in `dtype` (GEMMS), rebuilt from the quantized weights; the
        other's copy goes first, so only one is held at a time."""
        if self.dense.dtype != dtype:
            gemm = GEMMS[dtype]
            self.dense = None
            self.dense = gemm(self.reference())

    def reference(self) -> torch.Tensor:
        """The float32 weight this layer computes with ([out, in]), from its buffers: `reference_weight`'s."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:  # what a decode step reads
        return sum(buffer.nbytes for name, buffer in self.named_buffers() if name != "bias")


class Int8WeightLinear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias, reference_weight(weight, "int8"))
        codes, scales = int8_per_channel(weight.detach().float())
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales.to(torch.bfloat16))

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scales)

    def reference(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]


class Int4WeightLinear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None):
        if not supports_int4(weight.shape, group_size):
            raise ValueError(f"int4 weights in groups of {group_size} need {group_size} in {INT4_GROUP_SIZES}, "
                             f"inputs a multiple of it and outputs of 16: not {tuple(weight.shape)}")
        super().__init__(weight, bias, reference_weight(weight, "int4", group_size))
        self.group_size = group_size
        codes, scales, zeros = int4_groups(weight.detach().float(), group_size)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        # [in / group, out, 2]: the kernel's layout
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16))

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)

    def reference(self) -> torch.Tensor:
        # The codes out of the packed layout: the kernel's product with the identity, each group's scale 1 and
        # zero 8 (w = q, small integers bfloat16 holds exactly; its float32 path is unvectorized, seconds a layer)
        scales, zeros = self.scales_and_zeros.float().unbind(-1)  # [in / group, out] each
        unit = torch.stack([torch.ones_like(scales), torch.full_like(zeros, 8.0)], dim=-1).to(torch.bfloat16)
        identity = torch.eye(self.in_features, dtype=torch.bfloat16)
        codes = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, self.packed, self.group_size, unit).float().T
        groups = codes.reshape(self.out_features, -1, self.group_size)
        # reference_weight's arithmetic, in its order: bit for bit the same float32 weight
        return ((groups - 8) * scales.T[..., None] + zeros.T[..., None]).reshape(self.out_features, self.in_features)


def supports_int4(shape: torch.Size | tuple[int, int], group_size: int) -> bool:
    out_features, in_features = shape
    return group_size in INT4_GROUP_SIZES and in_features % group_size == 0 and out_features % 16 == 0


def reference_weight(weight: torch.Tensor, kind: str, group_size: int = 64) -> torch.Tensor:
    """The float32 weight a layer of `kind` (dynamic-int8, int8, int4) built from `weight` computes with:
    its codes times its scales, the scales rounded to bfloat16 where the kernel keeps them so."""
    weight = weight.detach().float()
    if kind in ("dynamic-int8", "int8"):
        codes, scales = int8_per_channel(weight)
        return codes.float() * (scales if kind == "dynamic-int8" else scales.bfloat16().float())[:, None]
    if kind == "int4":
        codes, scales, zeros = int4_groups(weight, group_size)
        scales, zeros = scales.bfloat16().float(), zeros.bfloat16().float()
        groups = codes.reshape(weight.shape[0], -1, group_size).float()
        return ((groups - 8) * scales[..., None] + zeros[..., None]).reshape(weight.shape)
    raise ValueError(f"unknown kind {kind!r}")


def warm_many_row_kernels(modules, max_rows: int) -> int:
    """Compiles the many-row GEMM kernels (kernels/bf16_gemm.py) of each distinct weight shape among the
    weight-only layers of `modules`, for every padded row count up to `max_rows`; returns the shapes warmed."""
    shapes = weight_only_layers_by_shape(modules)
    for module in shapes.values():
        module.dense.warm(max_rows)
    return len(shapes)


def weight_only_layers_by_shape(modules) -> dict[tuple[int, int], WeightOnlyLinear]:
    """One weight-only layer of each distinct (out, in) shape among `modules`: layers of one shape share
    their kernels and their timings."""
    shapes = {}
    for module in modules:
        if isinstance(module, WeightOnlyLinear):
            shapes.setdefault((module.out_features, module.in_features), module)
    return shapes


def use_gemm(modules, dtype: str) -> None:
    """Sends the many-row products of every weight-only layer among `modules` to the GEMM computing in `dtype`."""
    for module in modules:
        if isinstance(module, WeightOnlyLinear):
            module.use_gemm(dtype)


def many_row_products(modules) -> str:
    """Which GEMM the weight-only layers among `modules` send many rows to, and from how many rows ("" where
    there are none): a timing of their forwards holds for this choice only."""
    choices = sorted({(module.dense.dtype, module.dense_from_rows) for module in modules
                      if isinstance(module, WeightOnlyLinear)})
    return ", ".join(f"{dtype} GEMM from {rows} rows" for dtype, rows in choices)


def use_dense_from_rows(modules, rows: int) -> None:
    """Sends products of `rows` rows or more of every weight-only layer among `modules` to the GEMM."""
    for module in modules:
        if isinstance(module, WeightOnlyLinear):
            module.dense_from_rows = rows
