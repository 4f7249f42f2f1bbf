"""The bfloat16 GEMM behind the weight-only layers' many-row path (a prefill chunk, a big batch).

`F.linear` on a plain bfloat16 weight makes oneDNN reorder the whole weight into its blocked layout on every
call (~55 us for a 1536x576 weight on an Intel Xeon: as long as the GEMM of 16 rows itself), and compiles
and caches a kernel for every row count it meets, ~2.4 MB for the model's layers at each new count, kept
until the process ends (issue 28: what a hostile client's odd prompt lengths leave behind). So the weight
is reordered once, here, and the rows are padded to a multiple of ROW_STEP: a bounded set of shapes, whose
kernels `warm` compiles at start, so no request pays a kernel's compilation or leaves one behind.
BENCHMARKS.md (issues 28 and 31) has the measurements. Where oneDNN's bfloat16 path is missing (torch
without mkldnn) the layer keeps the plain `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_STEP = 16  # rows are padded up to a multiple of this: ≤ 15 wasted rows, chunk / 16 shapes


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def padded_rows(rows: int) -> int:
    return -(-rows // ROW_STEP) * ROW_STEP


class Bf16Gemm:
    """x @ weight.T for float32 rows, computed in bfloat16 with float32 accumulation; float32 out."""

    dtype = "bfloat16"

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        self.packed = packing_available()
        weight = weight.detach().to(torch.bfloat16).contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, None) if self.packed else weight

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [M, in_features] float32 → [M, out_features] float32."""
        if not self.packed:
            return F.linear(rows.to(torch.bfloat16), self.weight).float()
        count = rows.shape[0]
        padded = rows.new_empty((padded_rows(count), self.in_features), dtype=torch.bfloat16)
        padded[:count].copy_(rows)  # the conversion the GEMM needs anyway, into the padded buffer
        padded[count:].zero_()
        out = torch.ops.mkldnn._linear_pointwise(padded, self.weight, None, "none", [], "")
        return out[:count].float()

    def warm(self, max_rows: int) -> None:
        """Compiles the kernels of every padded row count up to `max_rows` (from ROW_STEP)."""
        for count in range(ROW_STEP, padded_rows(max_rows) + 1, ROW_STEP):
            self(torch.zeros(count, self.in_features))
