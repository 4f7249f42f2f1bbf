import gc

import pytest
import torch

from kernels.bf16_gemm import ROW_STEP, Bf16Gemm, packing_available
from kernels.weight_linear import Int4WeightLinear, warm_many_row_kernels
from statekeeper.memory import heap_bytes


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at each value (8 significant bits)."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


@pytest.mark.parametrize("rows", [1, ROW_STEP - 1, ROW_STEP, 37, 200])
def test_product_is_the_bf16_inputs_product_rounded_once_to_bf16(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(96, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    got = Bf16Gemm(weight)(x)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    # float32 accumulation of bfloat16 products (exact in float32) in any order, then one rounding to
    # bfloat16: within one bfloat16 spacing of the exact product of the rounded inputs
    exact = x.bfloat16().double() @ weight.bfloat16().double().T
    assert bool(((got.double() - exact).abs() <= _bf16_ulp(exact)).all())


def test_a_row_does_not_depend_on_the_rows_padded_beside_it():
    generator = torch.Generator().manual_seed(0)
    gemm = Bf16Gemm(torch.randn(48, 64, generator=generator))
    x = torch.randn(ROW_STEP + 3, 64, generator=generator)
    assert torch.equal(gemm(x)[:ROW_STEP + 1], gemm(x[:ROW_STEP + 1]))  # both padded to 2 * ROW_STEP


@pytest.mark.skipif(heap_bytes() is None or not packing_available(), reason="glibc's heap and oneDNN's bf16")
def test_after_warming_new_row_counts_leave_no_kernels_behind():
    """Each row count a GEMM had not met used to leave its compiled kernel in oneDNN's and ideep's caches
    (~0.6 MB for this shape, kept for the process's life): a hostile client's odd prompt lengths grew the
    server (issue 28). Warmed to 128 rows, 100 new counts up to 128 leave nothing that size."""
    layer = Int4WeightLinear(torch.randn(1536, 576) * 0.05, 32)
    assert warm_many_row_kernels([layer], 128) == 1
    layer(torch.randn(17, 576))  # the allocator's own first-use growth, before the reading
    gc.collect()
    before = heap_bytes()["in_use"]
    for rows in range(ROW_STEP + 1, 129):
        if rows % ROW_STEP:
            layer(torch.randn(rows, 576))
    gc.collect()
    assert heap_bytes()["in_use"] - before < 4 << 20  # one kernel per new count would be ~50 MB
