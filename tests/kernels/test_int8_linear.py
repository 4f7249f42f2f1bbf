import pytest
import torch

from kernels.int8_linear import Int8Linear, int8_versions, linear_reference, swapped_linears


def test_int8_linear_is_close_to_the_fp32_reference():
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=generator) * 0.1, torch.randn(48, generator=generator)
    x = torch.randn(2, 10, 64, generator=generator)
    expected = linear_reference(x, weight, bias)
    got = Int8Linear.from_weight(weight, bias)(x)
    assert got.shape == expected.shape == (2, 10, 48)
    assert (got - expected).norm() / expected.norm() < 0.03


def test_int8_linear_checks_its_input():
    int8 = Int8Linear.from_weight(torch.randn(8, 16))
    with pytest.raises(ValueError):
        int8(torch.randn(3, 15))
    with pytest.raises(ValueError):
        int8(torch.randn(3, 16, dtype=torch.float64))


def test_swapped_linears_are_restored_even_on_error():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 16)
    with torch.inference_mode():
        expected = model(x)
        versions = int8_versions([m for m in model if isinstance(m, torch.nn.Linear)])
        assert len(versions) == 2
        with swapped_linears(versions):
            approximate = model(x)
        assert not torch.equal(approximate, expected) and torch.allclose(approximate, expected, atol=0.05)
        with pytest.raises(RuntimeError), swapped_linears(versions):
            raise RuntimeError("scoring failed")
        assert all("forward" not in vars(m) for m in model)
        assert torch.equal(model(x), expected)
