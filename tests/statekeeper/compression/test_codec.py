import pytest
import torch

from statekeeper.compression import codec


def _named():
    torch.manual_seed(0)
    return [("0.k", torch.randn(3, 50, 64)), ("0.v", torch.randn(3, 50, 64)),
            ("0+1.v.norm_a", torch.rand(150)), ("0+1.v.retained", torch.rand(3, 50) > 0.5),
            ("0+1.v.original_a", torch.randn(0, 64)), ("0.index", torch.randn(3, 64))]


@pytest.mark.parametrize(("bits", "tolerance", "max_fraction"), [(8, 0.004, 0.27), (4, 0.04, 0.15)])
def test_head_dim_vectors_are_quantized_and_everything_else_kept(bits, tolerance, max_fraction):
    named = _named()
    stored, meta = codec.IntCodec(bits, 64).encode(named, head_dim=64)
    assert set(meta["tensors"]) == {"0.k", "0.v"} and meta["codec"] == f"int{bits}"
    names = [name for name, _ in stored]
    assert "0.k.codes" in names and "0.k" not in names and "0+1.v.norm_a" in names
    kv_bytes = sum(t.nbytes for name, t in stored if name.startswith(("0.k", "0.v")))
    assert kv_bytes < max_fraction * (named[0][1].nbytes + named[1][1].nbytes)
    restored = codec.decode(dict(stored), meta)
    for name, tensor in named:
        assert restored[name].dtype == tensor.dtype and restored[name].shape == tensor.shape
        if name in meta["tensors"]:
            assert not torch.equal(restored[name], tensor)
            assert (restored[name] - tensor).abs().max() <= tolerance * (tensor.max() - tensor.min())
        else:
            assert torch.equal(restored[name], tensor)


def test_a_description_that_does_not_fit_its_tensors_raises():
    stored, meta = codec.IntCodec(8).encode(_named()[:1], head_dim=64)
    meta["tensors"]["0.k"]["shape"] = [3, 51, 64]
    with pytest.raises(RuntimeError):
        codec.decode(dict(stored), meta)
    del meta["tensors"]["0.k"]["bits"]
    with pytest.raises(KeyError):
        codec.decode(dict(stored), meta)


def test_codec_names():
    assert codec.by_name("none") is None and codec.by_name("int4", 32) == codec.IntCodec(4, 32)
    with pytest.raises(ValueError):
        codec.by_name("int2")
