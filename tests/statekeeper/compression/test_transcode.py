import pytest
import torch

from statekeeper.compression import by_name, restore_state
from statekeeper.compression.transcode import Transcoder, effective_codec
from storage import serialization

TOKENS = list(range(256))


def _layers(num_layers=2, heads=2, tokens=256, head_dim=64):
    torch.manual_seed(0)
    return [(torch.randn(heads, tokens, head_dim), torch.randn(heads, tokens, head_dim)) for _ in range(num_layers)]


def _blob(layers, method="none"):
    if method == "none":
        return serialization.encode(layers, "model-a", TOKENS)
    compressed = by_name(method).compress(layers)
    return serialization.encode_tensors(compressed.tensors, "model-a", TOKENS, len(TOKENS), compressed.meta)


def _restored(blob, num_layers=2):
    header, tensors = serialization.decode_tensors(blob, "model-a", TOKENS)
    return header, restore_state(tensors, header.meta, num_layers)[0]


def test_plain_blob_is_quantized_for_the_tier_and_still_belongs_to_its_conversation():
    layers = _layers()
    plain = _blob(layers)
    small = Transcoder("int4-rot-g32")(plain)
    assert len(small) < 0.25 * len(plain)
    header, restored = _restored(small)  # same model and tokens: decode_tensors accepts it
    assert header.meta["quant"]["codec"] == "int4-rot-g32"
    for (k, v), (rk, rv) in zip(layers, restored):
        assert rk.shape == k.shape and (rk - k).norm() / k.norm() < 0.15 and (rv - v).norm() / v.norm() < 0.15
    with pytest.raises(serialization.BlobError):
        serialization.decode_tensors(small, "model-b", TOKENS)


def test_blob_with_fewer_or_equal_bits_stays_as_written():
    int4 = _blob(_layers(), "int4")
    assert Transcoder("int8")(int4) is int4 and Transcoder("int4-rot")(int4) is int4


def test_int8_blob_goes_down_to_int4_once():
    layers = _layers()
    int8 = _blob(layers, "int8")
    int4 = Transcoder("int4")(int8)
    header, restored = _restored(int4)
    assert header.meta["quant"]["codec"] == "int4" and len(int4) < 0.7 * len(int8)
    assert (restored[0][0] - layers[0][0]).norm() / layers[0][0].norm() < 0.15


def test_corrupt_blob_is_refused_not_transcoded():
    blob = bytearray(_blob(_layers()))
    blob[-1] ^= 0xFF
    with pytest.raises(serialization.BlobError):
        Transcoder("int4")(blob)


@pytest.mark.parametrize("written, tier, expected", [("none", "int4", "int4"), ("int8", "int4", "int4"),
                                                     ("int4", "int8", "int4"), ("int4-rot", "int4", "int4-rot"),
                                                     ("none", "none", "none"), ("int8", "none", "int8"),
                                                     ("int4-rot", "int4-v2-rot", "int4-v2-rot"),
                                                     ("int4-v3", "int4", "int4-v3"), ("int8-v4", "int4", "int4")])
def test_effective_codec(written, tier, expected):
    assert effective_codec(written, tier) == expected


def test_a_per_head_blob_with_kept_bits_goes_down_to_symmetric_codes_with_its_sink_exact():
    from statekeeper.compression.attention_stats import AttentionStats

    layers = _layers()
    stats = AttentionStats(2)
    stats.recent_queries = [torch.randn(4, 8, 64).half() for _ in range(2)]
    compressed = by_name("expected@0.5").compress(layers, stats)
    evicted = serialization.encode_tensors(compressed.tensors, "model-a", TOKENS, len(TOKENS), compressed.meta)
    small = Transcoder("int4-v3-rot-sym-s1")(evicted)
    header, tensors = serialization.decode_tensors(small, "model-a", TOKENS)
    assert header.meta["quant"]["codec"] == "int4-v3-rot-sym-s1" and "0.kept" in tensors
    assert "0.k.zero" not in tensors and "0.k.exact" in tensors
    restored, bias = restore_state(tensors, header.meta, 2)
    exact, _ = restore_state(dict(compressed.tensors), compressed.meta, 2)
    for (k, v), (rk, rv), b in zip(exact, restored, bias):
        alive = torch.isfinite(b)
        assert torch.allclose(rk[:, 0], k[:, 0], atol=1e-2)  # token 0 kept exact through the tier's codec
        assert (rk - k)[alive].norm() / k[alive].norm() < 0.15 and (rv - v)[alive].norm() / v[alive].norm() < 0.3
