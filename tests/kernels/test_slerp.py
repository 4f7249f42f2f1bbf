import torch

from kernels.slerp import slerp_merge, unmerge


def test_identical_layers_merge_losslessly():
    torch.manual_seed(0)
    a = torch.randn(3, 20, 16)
    restored_a, restored_b = unmerge(slerp_merge(a, a * 2.0))
    assert torch.allclose(restored_a, a, atol=1e-5) and torch.allclose(restored_b, a * 2.0, atol=1e-5)


def test_magnitudes_are_kept_and_directions_shared():
    torch.manual_seed(0)
    a, b = torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    pair = slerp_merge(a, b, retain_angle=1.0)  # merge everything
    restored_a, restored_b = unmerge(pair)
    assert torch.allclose(restored_a.norm(dim=-1), a.norm(dim=-1), atol=1e-5)
    assert torch.allclose(restored_b.norm(dim=-1), b.norm(dim=-1), atol=1e-5)
    unit_a = restored_a / restored_a.norm(dim=-1, keepdim=True)
    unit_b = restored_b / restored_b.norm(dim=-1, keepdim=True)
    assert torch.allclose(unit_a, unit_b, atol=1e-5)


def test_slerp_midpoint_bisects_the_angle():
    a = torch.tensor([[[1.0, 0.0]]])
    b = torch.tensor([[[0.0, 3.0]]])
    pair = slerp_merge(a, b, t=0.5, retain_angle=1.0)
    assert torch.allclose(pair.direction, torch.tensor([[2**-0.5, 2**-0.5]]), atol=1e-6)


def test_distant_tokens_are_retained_exactly():
    a = torch.tensor([[[1.0, 0.0], [1.0, 0.1]]])
    b = torch.tensor([[[-1.0, 0.0], [1.0, 0.0]]])  # token 0 is opposite: 180 degrees
    pair = slerp_merge(a, b, retain_angle=0.5)
    assert pair.retained.tolist() == [[True, False]]
    restored_a, restored_b = unmerge(pair)
    assert torch.equal(restored_a[0, 0], a[0, 0]) and torch.equal(restored_b[0, 0], b[0, 0])
    # one merged row (direction + 2 norms), one retained row (2 vectors), a 2-row bool mask
    assert pair.stored_bytes == 1 * (2 + 2) * 4 + 1 * 2 * 2 * 4 + 2


def test_tensors_roundtrip():
    torch.manual_seed(0)
    pair = slerp_merge(torch.randn(2, 6, 4), torch.randn(2, 6, 4), retain_angle=0.4)
    again = type(pair).from_tensors(dict(pair.tensors("p")), "p")
    assert all(torch.equal(x, y) for x, y in zip(unmerge(pair), unmerge(again)))
