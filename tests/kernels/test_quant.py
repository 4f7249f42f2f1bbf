import pytest
import torch

from kernels.quant import dequantize, quantize


@pytest.mark.parametrize("bits, tolerance", [(8, 1 / 255), (4, 1 / 15)])
@pytest.mark.parametrize("dim", [-1, 1])
def test_error_is_within_half_a_step_of_each_group_range(bits, tolerance, dim):
    torch.manual_seed(0)
    x = torch.randn(3, 128, 64)
    q = quantize(x, bits=bits, dim=dim, group_size=32)
    restored = dequantize(q)
    assert restored.shape == x.shape and restored.dtype == x.dtype
    groups = x.movedim(dim, -1).reshape(3, -1, 32) if dim == -1 else x.movedim(1, -1).reshape(3, 64, -1, 32)
    step = (groups.amax(-1) - groups.amin(-1)).max() * tolerance
    assert (restored - x).abs().max() <= step * 0.5 + 1e-2  # fp16 scale/zero add a little


def test_sizes():
    x = torch.randn(3, 128, 64)
    for bits in (8, 4, 3, 2):
        assert quantize(x, bits=bits, group_size=64).codes.nbytes == x.numel() * bits // 8


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packed_codes_round_trip_any_count(bits):
    from kernels.quant import pack, unpack

    for count in (1, 7, 8, 77):
        codes = torch.randint(0, 1 << bits, (count,), dtype=torch.uint8)
        assert torch.equal(unpack(pack(codes, bits), bits, count), codes)


def test_constant_groups_roundtrip_exactly_enough():
    x = torch.full((2, 64), 3.0)
    assert torch.allclose(dequantize(quantize(x, bits=4, group_size=64)), x, atol=1e-3)


def test_group_size_must_divide():
    with pytest.raises(ValueError):
        quantize(torch.randn(2, 10), group_size=4)


@pytest.mark.parametrize("bits", [2, 3])
def test_few_bits_clip_the_range_where_it_lowers_the_error(bits):
    import kernels.quant as quant

    torch.manual_seed(0)
    x = torch.randn(3, 128, 64)
    clipped = (dequantize(quantize(x, bits=bits, group_size=32)) - x).square().mean()
    saved, quant.CLIP_RATIOS = quant.CLIP_RATIOS, ()
    try:
        min_max = (dequantize(quantize(x, bits=bits, group_size=32)) - x).square().mean()
    finally:
        quant.CLIP_RATIOS = saved
    assert clipped < min_max * (0.75 if bits == 2 else 0.95)
