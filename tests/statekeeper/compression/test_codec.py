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


@pytest.mark.parametrize("shape", [(3, 50, 64), (77, 64), (2, 64, 64)])
def test_keys_grouped_per_channel_round_trip_any_token_count(shape):
    torch.manual_seed(0)
    keys = torch.randn(*shape) * torch.linspace(0.1, 5, 64)  # channels of very different ranges
    values = torch.randn(*shape)
    per_channel, meta = codec.IntCodec(4, 32, keys_per_channel=True).encode([("0.k", keys), ("0.v", values)], 64)
    per_token, _ = codec.IntCodec(4, 32).encode([("0.k", keys), ("0.v", values)], 64)
    assert meta["codec"] == "int4-kc-g32" and meta["tensors"]["0.k"]["axis"] == "tokens"
    restored = codec.decode(dict(per_channel), meta)
    assert restored["0.k"].shape == keys.shape and restored["0.v"].shape == values.shape
    plain = codec.decode(dict(per_token), _)
    # With outlier channels, per-channel groups fit keys better than per-token groups.
    assert (restored["0.k"] - keys).abs().mean() < (plain["0.k"] - keys).abs().mean()
    assert torch.equal(restored["0.v"], plain["0.v"])


def test_codec_names_include_per_channel_keys():
    assert codec.by_name("int8-kc") == codec.IntCodec(8, 64, True)
    from statekeeper.compression import by_name

    assert by_name("int4-kc").codec.keys_per_channel and by_name("kvzip@0.5+int4-kc").codec.bits == 4


def test_rotated_rows_round_trip_at_the_same_bytes_with_less_error():
    torch.manual_seed(0)
    keys = torch.randn(3, 50, 64)
    keys[..., 7] *= 30  # one outlier channel, as post-RoPE keys have
    plain, plain_meta = codec.IntCodec(4).encode([("0.k", keys)], 64)
    rotated, meta = codec.IntCodec(4, rotate=True).encode([("0.k", keys)], 64)
    assert meta["codec"] == "int4-rot" and "rotation" in meta["tensors"]["0.k"]
    assert sum(t.nbytes for _, t in rotated) == sum(t.nbytes for _, t in plain)
    restored = codec.decode(dict(rotated), meta)["0.k"]
    baseline = codec.decode(dict(plain), plain_meta)["0.k"]
    assert restored.shape == keys.shape and restored.dtype == keys.dtype
    assert (restored - keys).norm() < 0.6 * (baseline - keys).norm()


def test_rotation_is_orthonormal_and_needs_a_power_of_two():
    from kernels.quant import rotation

    r = rotation(64)
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-6) and not torch.allclose(r, rotation(64, seed=1))
    with pytest.raises(ValueError):
        rotation(48)


@pytest.mark.parametrize("name, expected", [("int4-rot", codec.IntCodec(4, 64, False, True)),
                                            ("int4-kc-rot-g32", codec.IntCodec(4, 32, True, True)),
                                            ("int8-g16", codec.IntCodec(8, 16)),
                                            ("int4-rot-g32-s1", codec.IntCodec(4, 32, False, True, 1)),
                                            ("int4-v2-rot-g32-vg64-s1", codec.IntCodec(4, 32, False, True, 1, 2, 64)),
                                            ("int8-v3-kc", codec.IntCodec(8, 64, True, value_bits=3)),
                                            ("int4-v3-rot-pk10-s1", codec.IntCodec(4, 64, False, True, 1, 3, None, 10))])
def test_codec_names_with_options(name, expected):
    assert codec.by_name(name) == expected and expected.name == name


@pytest.mark.parametrize("name", ["int4-rot-kc", "int4-g", "int4-g24", "int4-g1", "int16", "int4-s1-rot", "int4-s",
                                  "int2", "int3", "int4-v5", "int4-rot-v2", "int4-vg64-g32", "int4-v2-vg48",
                                  "int8-pk10", "int4-pk0", "int4-pk100", "int4-s1-pk10"])
def test_bad_codec_names_are_refused(name):
    with pytest.raises(ValueError):
        codec.by_name(name)


@pytest.mark.parametrize("name", ["int4-rot-g32-s2", "int4-kc-s2"])
def test_the_first_tokens_rows_come_back_exact_in_a_dense_state(name):
    torch.manual_seed(0)
    keys, values = torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    stored, meta = codec.by_name(name).encode([("0.k", keys), ("0.v", values)], 64)
    restored = codec.decode(dict(stored), meta)
    for original, back in ((keys, restored["0.k"]), (values, restored["0.v"])):
        assert torch.allclose(back[:, :2], original[:, :2], atol=1e-2)  # 16-bit
        assert not torch.allclose(back[:, 2:], original[:, 2:], atol=1e-2)  # int4
    plain, _ = codec.by_name(name.rpartition("-s")[0]).encode([("0.k", keys), ("0.v", values)], 64)
    extra = sum(t.nbytes for _, t in stored) - sum(t.nbytes for _, t in plain)
    assert extra == 2 * (3 * 2 * 64 * 2 + 3 * 2 * 4)  # K and V: 6 rows of fp16 and their int32 row numbers


def test_the_first_tokens_rows_come_back_exact_after_per_head_eviction():
    from statekeeper.compression import by_name, restore_state
    from tests.statekeeper.compression.test_head_budget import LAYERS, _state

    layers, stats = _state()
    compressed = by_name("expected@0.4+int4-s1").compress(layers, stats)
    assert "0.k.exact" in dict(compressed.tensors)
    back, bias = restore_state(dict(compressed.tensors), compressed.meta, LAYERS)
    for (k, v), (k2, v2), b in zip(layers, back, bias):
        assert torch.isfinite(b[:, 0]).all()  # sinks are always kept
        assert torch.allclose(k2[:, 0], k[:, 0], atol=1e-2) and torch.allclose(v2[:, 0], v[:, 0], atol=1e-2)
        assert not torch.allclose(k2[:, 1:][torch.isfinite(b[:, 1:])], k[:, 1:][torch.isfinite(b[:, 1:])], atol=1e-2)


@pytest.mark.parametrize("value_bits, value_group", [(2, None), (3, None), (2, 64), (8, 16)])
def test_values_at_their_own_precision(value_bits, value_group):
    from statekeeper.config import codec_options

    torch.manual_seed(0)
    keys, values = torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    group = 32
    name = f"int4-v{value_bits}-rot-g{group}" + (f"-vg{value_group}" if value_group else "")
    assert codec_options(name)["value_bits"] == value_bits  # what the config checks is what the codec builds
    mixed = codec.by_name(name)
    stored, meta = mixed.encode([("0.k", keys), ("0.v", values)], 64)
    plain, plain_meta = codec.by_name(f"int4-rot-g{group}").encode([("0.k", keys), ("0.v", values)], 64)
    named, plain_named = dict(stored), dict(plain)
    assert torch.equal(named["0.k.codes"], plain_named["0.k.codes"])  # keys as in the plain codec
    groups = 3 * 50 * 64 // (value_group or group)
    assert named["0.v.codes"].nbytes == 3 * 50 * 64 * value_bits // 8 and named["0.v.scale"].numel() == groups
    assert meta["tensors"]["0.v"]["bits"] == value_bits and meta["codec"] == name
    restored, baseline = codec.decode(named, meta), codec.decode(plain_named, plain_meta)
    assert torch.equal(restored["0.k"], baseline["0.k"]) and restored["0.v"].shape == values.shape
    error, int4_error = (restored["0.v"] - values).norm(), (baseline["0.v"] - values).norm()
    assert error > int4_error if value_bits < 4 else error < int4_error


def test_the_top_scored_key_rows_are_written_at_eight_bits():
    torch.manual_seed(0)
    keys, values = torch.randn(100, 64), torch.randn(100, 64)  # a per-head ragged layer's kept rows
    scores = torch.rand(100)
    top = scores.topk(10).indices
    named = [("0.k", keys), ("0.v", values)]
    stored, meta = codec.by_name("int4-rot-g32-pk10").encode(named, 64, {"0.k": scores, "0.v": scores})
    plain, plain_meta = codec.by_name("int4-rot-g32").encode(named, 64)
    restored, baseline = codec.decode(dict(stored), meta), codec.decode(dict(plain), plain_meta)
    error, plain_error = (restored["0.k"] - keys).norm(dim=1), (baseline["0.k"] - keys).norm(dim=1)
    assert restored["0.k"].shape == keys.shape and error[top].max() < 0.1 * plain_error[top].min()
    rest = torch.ones(100, dtype=torch.bool)
    rest[top] = False
    assert error[rest].max() < 2 * plain_error.max() and torch.equal(restored["0.v"], baseline["0.v"])
    extra = sum(t.nbytes for _, t in stored) - sum(t.nbytes for _, t in plain)
    assert extra == 10 * (64 - 32) + 13  # per row 8-bit codes for 4-bit ones, and a bit per row (100) saying which
    # Without scores (a dense state, a blob re-encoded for a tier) every row is written at 4 bits.
    unscored, unscored_meta = codec.by_name("int4-rot-g32-pk10").encode(named, 64)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(unscored, plain))


def test_per_head_eviction_gives_the_codec_its_kept_rows_scores():
    from statekeeper.compression import by_name, restore_state
    from tests.statekeeper.compression.test_head_budget import LAYERS, _state

    layers, stats = _state()
    compressed = by_name("expected@0.4+int4-pk20-s1").compress(layers, stats)
    tensors = dict(compressed.tensors)
    kept_rows = int(tensors["0.counts"].sum())
    from kernels.quant import unpack_mask

    assert int(unpack_mask(tensors["0.k.precise_mask"]).sum()) == -(-kept_rows * 20 // 100)
    assert "0.v.precise_mask" not in tensors
    back, bias = restore_state(tensors, compressed.meta, LAYERS)
    plain = by_name("expected@0.4+int4-s1").compress(layers, stats)
    plain_back, _ = restore_state(dict(plain.tensors), plain.meta, LAYERS)
    for (k, _), (k2, _), (k3, _), b in zip(layers, back, plain_back, bias):
        alive = torch.isfinite(b)
        assert (k2 - k)[alive].norm() < (k3 - k)[alive].norm()


@pytest.mark.parametrize("name, symmetric", [("int4-v3-rot-sym-pk10-s1", ("k", "v")), ("int4-v3-rot-vsym", ("v",))])
def test_symmetric_codes_drop_the_zero_points_and_only_those_bytes(name, symmetric):
    torch.manual_seed(0)
    keys, values = torch.randn(100, 64), torch.randn(100, 64)  # a per-head ragged layer's kept rows
    scores = torch.rand(100)
    named, row_scores = [("0.k", keys), ("0.v", values)], {"0.k": scores, "0.v": scores}
    sym = codec.by_name(name)
    assert sym.name == name and sym.symmetric_values and sym.symmetric_keys == ("k" in symmetric)
    stored, meta = sym.encode(named, 64, row_scores)
    plain_name = name.replace("-vsym", "").replace("-sym", "")
    plain, plain_meta = codec.by_name(plain_name).encode(named, 64, row_scores)
    stored_names = {n for n, _ in stored}
    assert {f"0.{part}.zero" for part in symmetric}.isdisjoint(stored_names)
    assert ("0.k.precise.zero" in stored_names) == ("k" not in symmetric and "pk" in name)
    precise_rows = 10 if "pk" in name else 0
    # One fp16 zero point per row (groups of 64) of each symmetric tensor, nothing else changes.
    saved = sum(t.nbytes for _, t in plain) - sum(t.nbytes for _, t in stored)
    assert saved == 2 * 100 * len(symmetric)
    assert all(meta["tensors"][f"0.{part}"].get("symmetric", False) == (part in symmetric) for part in "kv")
    restored, baseline = codec.decode(dict(stored), meta), codec.decode(dict(plain), plain_meta)
    for part, original in (("k", keys), ("v", values)):
        error, plain_error = (restored[f"0.{part}"] - original).norm(), (baseline[f"0.{part}"] - original).norm()
        assert restored[f"0.{part}"].shape == original.shape
        assert error < 1.2 * plain_error if part in symmetric else torch.equal(restored[f"0.{part}"],
                                                                                baseline[f"0.{part}"])
    assert precise_rows == meta["tensors"]["0.k"].get("precise", {}).get("rows", 0)


@pytest.mark.parametrize("name", ["int4-sym", "int4-kc-rot-sym", "int4-rot-g32-sym", "int4-sym-rot"])
def test_symmetric_codes_need_rotated_rows_grouped_per_token(name):
    with pytest.raises(ValueError):
        codec.by_name(name)
    with pytest.raises(ValueError):
        codec.IntCodec(4, rotate=True, symmetric_keys=True)


def test_a_symmetric_blob_missing_its_scale_is_refused():
    stored, meta = codec.by_name("int4-rot-sym").encode([("0.k", torch.randn(3, 50, 64))], 64)
    broken = {name: tensor for name, tensor in stored if name != "0.k.scale"}
    with pytest.raises(KeyError):
        codec.decode(broken, meta)
