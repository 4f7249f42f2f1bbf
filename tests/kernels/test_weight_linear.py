import pytest
import torch
import torch.nn.functional as F

from kernels.weight_linear import (DENSE_FROM_ROWS, DynamicInt8Linear, Int4WeightLinear, Int8WeightLinear,
                                   reference_weight, use_gemm)

# Relative error (norm) against the reference: the weight-only kernels round their input to bfloat16
# (2^-9 relative) and accumulate in another order; the dynamic one rounds its input to 7-8 bits.
LAYERS = [("int8", lambda w, b: Int8WeightLinear(w, b), 0.005),
          ("int4", lambda w, b: Int4WeightLinear(w, 32, b), 0.005),
          ("dynamic-int8", lambda w, b: DynamicInt8Linear(w, b), 0.02)]
# ... and against the float32 weight they were made from: what the quantization itself costs.
FROM_FP32 = {"int8": 0.01, "int4": 0.08, "dynamic-int8": 0.025}


def _weights(out_features=48, in_features=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    return weight, torch.randn(out_features, generator=generator), generator


def _relative(got, expected):
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("kind, make, tolerance", LAYERS, ids=[kind for kind, _, _ in LAYERS])
@pytest.mark.parametrize("rows", [1, 3, DENSE_FROM_ROWS, 200])  # the kernel, and the dense path from 16 rows
def test_quantized_linear_is_close_to_its_reference(kind, make, tolerance, rows):
    weight, bias, generator = _weights()
    x = torch.randn(2, rows, 128, generator=generator)
    layer = make(weight, bias)
    got = layer(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.float32
    assert _relative(got, F.linear(x, reference_weight(weight, kind, 32), bias)) < tolerance
    assert _relative(got, F.linear(x, weight, bias)) < FROM_FP32[kind]


@pytest.mark.parametrize("kind, make, tolerance", LAYERS, ids=[kind for kind, _, _ in LAYERS])
def test_quantized_linear_is_deterministic_and_checks_its_input(kind, make, tolerance):
    weight, bias, generator = _weights()
    layer = make(weight, bias)
    x = torch.randn(5, 128, generator=generator)
    assert torch.equal(layer(x), layer(x.clone()))
    with pytest.raises(ValueError):
        layer(torch.randn(3, 127))
    with pytest.raises(ValueError):
        layer(x.double())


def test_int4_reference_weight_is_the_groups_codes():
    weight, _, _ = _weights()
    dequantized = reference_weight(weight, "int4", 32)
    for group in range(128 // 32):  # 16 levels per group of 32 inputs, spanning its range
        block = dequantized[:, group * 32 : (group + 1) * 32]
        assert all(len(row.unique()) <= 16 for row in block)
    assert _relative(dequantized, weight) < 0.1 and _relative(reference_weight(weight, "int8"), weight) < 0.01


@pytest.mark.parametrize("kind, make", [("int8", lambda w: Int8WeightLinear(w)),
                                        ("int4", lambda w: Int4WeightLinear(w, 32)),
                                        ("int4-g64", lambda w: Int4WeightLinear(w, 64))])
def test_a_layer_gives_back_the_exact_weight_it_computes_with(kind, make):
    """Read back from the layer's own buffers (the int4 codes out of the kernel's packed layout): the weight the
    float32 GEMM is built from is reference_weight's, bit for bit."""
    weight, _, _ = _weights(96, 256)
    group = 64 if kind == "int4-g64" else 32
    assert torch.equal(make(weight).reference(), reference_weight(weight, kind.split("-")[0], group))


@pytest.mark.parametrize("make", [lambda w, b: Int8WeightLinear(w, b), lambda w, b: Int4WeightLinear(w, 32, b)])
def test_the_float32_gemm_computes_many_rows_with_the_exact_weight(make):
    weight, bias, generator = _weights()
    layer = make(weight, bias)
    x = torch.randn(DENSE_FROM_ROWS + 5, 128, generator=generator)
    use_gemm([layer], "bfloat16")
    in_bfloat16 = layer(x)
    use_gemm([layer], "float32")
    assert layer.dense.dtype == "float32"
    reference = layer.reference()
    assert torch.equal(layer(x), F.linear(x, reference) + bias)  # the same call on the same float32 weight
    assert torch.equal(layer(x[:3]), layer.few_rows(x[:3]) + bias)  # few rows stay on the kernel
    use_gemm([layer], "bfloat16")
    assert layer.dense.dtype == "bfloat16" and torch.equal(layer(x), in_bfloat16)  # rebuilt as it was


def test_int4_refuses_shapes_its_kernel_cannot_take():
    with pytest.raises(ValueError, match="groups of 32"):
        Int4WeightLinear(torch.randn(48, 48), 32)  # inputs not a multiple of the group
    with pytest.raises(ValueError):
        Int4WeightLinear(torch.randn(40, 64), 32)  # outputs not a multiple of 16
    with pytest.raises(ValueError):
        Int4WeightLinear(torch.randn(48, 64), 16)  # a group size the kernel does not take


def test_decode_reads_fewer_bytes_than_fp32():
    weight, _, _ = _weights(576, 576)
    fp32 = weight.nbytes
    assert Int8WeightLinear(weight).weight_bytes < 0.26 * fp32
    assert Int4WeightLinear(weight, 64).weight_bytes < 0.15 * fp32  # 4 bits and 4 bytes of scale and zero per 64
