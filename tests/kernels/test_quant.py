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


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_symmetric_codes_store_no_zero_point_and_stay_within_half_a_step(bits):
    torch.manual_seed(0)
    x = torch.randn(3, 128, 64)
    q = quantize(x, bits=bits, group_size=32, symmetric=True)
    asymmetric = quantize(x, bits=bits, group_size=32)
    assert q.zero is None and q.nbytes == asymmetric.nbytes - asymmetric.zero.nbytes
    assert q.nbytes == x.numel() * bits // 8 + 2 * x.numel() // 32  # codes and one fp16 scale per group
    restored = dequantize(q)
    assert restored.shape == x.shape and restored.dtype == x.dtype
    step = 2 * x.reshape(3, 128, 2, 32).abs().amax(-1) / ((1 << bits) - 1)  # the widest (unclipped) step
    error = (restored - x).abs().reshape(3, 128, 2, 32).amax(-1)
    if bits >= 4:  # min-max range: every element within half a step (fp16 scale adds a little)
        assert bool((error <= step * 0.5 * 1.01 + 1e-3).all())
    # On zero-mean rows the range centred on zero costs little against min-max
    symmetric_error, asymmetric_error = (restored - x).square().mean(), (dequantize(asymmetric) - x).square().mean()
    assert symmetric_error < 1.35 * asymmetric_error


def test_a_mask_is_counted_and_checked_past_a_length_without_unpacking():
    from kernels.quant import mask_count, mask_set_past, pack_mask

    generator = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 5, 77, generator=generator) > 0.97  # sparse: the last set bit varies by row
    packed = pack_mask(mask)
    assert torch.equal(mask_count(packed), mask.sum(dim=-1))
    for cut in range(8 * packed.shape[-1] + 1):
        assert mask_set_past(packed, cut) == bool(mask[..., cut:].any()), cut
    assert not mask_set_past(pack_mask(torch.ones(2, 13, dtype=torch.bool)), 13)
    assert mask_set_past(pack_mask(torch.ones(2, 13, dtype=torch.bool)), 12)


def test_masks_pack_eight_to_a_byte():
    from kernels.quant import pack_mask, unpack_mask

    mask = torch.rand(3, 77) > 0.5
    packed = pack_mask(mask)
    assert packed.shape == (3, 10) and packed.dtype == torch.uint8
    bits = unpack_mask(packed)
    assert torch.equal(bits[:, :77], mask) and not bits[:, 77:].any()
    assert pack_mask(torch.tensor([True, False, False, True])).tolist() == [0b1001]
