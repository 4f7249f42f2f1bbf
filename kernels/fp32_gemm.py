"""The float32 GEMM the weight-only layers' many-row path can take instead of the bfloat16 one
(kernels/bf16_gemm.py), over the same dequantized weights.

On a CPU without AVX-512 BF16 or AMX (an AVX2-only AMD EPYC, older Xeons) bfloat16 arithmetic is emulated and
the weight-only kernels take bfloat16 activations only, so a prefill chunk runs at about half the speed MKL's
float32 GEMM gives over the layer's exact float32 weight, at twice the bfloat16 copy's memory (4 bytes a
weight). Which GEMM a machine uses is measured at start (statekeeper/dense_rows_choice.py); BENCHMARKS.md has
the timings. MKL's float32 GEMM keeps no kernel per row count (checked as in issue 28: 500 new counts grow the
process by ~10 MB of allocator pages, not by a kernel each), so rows go in as they come, without padding."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Fp32Gemm:
    """x @ weight.T for float32 rows over the float32 weight; float32 out."""

    dtype = "float32"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().float().contiguous()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [M, in_features] float32 → [M, out_features] float32."""
        return F.linear(rows, self.weight)

    def warm(self, max_rows: int) -> None:
        """Nothing to compile: MKL's GEMM has no per-shape kernels (the interface Bf16Gemm's warm gives)."""
