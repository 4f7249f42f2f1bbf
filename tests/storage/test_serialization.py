import pytest
import torch

from storage import serialization
from storage.serialization import BlobError


def _layers(num_layers=3, tokens=7, dtype=torch.float32):
    torch.manual_seed(0)
    return [(torch.randn(2, tokens, 8).to(dtype), torch.randn(2, tokens, 8).to(dtype)) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_roundtrip_is_bit_exact(dtype):
    layers = _layers(dtype=dtype)
    tokens = list(range(100, 108))  # one more token than the KV covers, as after a turn
    blob = serialization.encode(layers, "model-a", tokens)
    header, decoded = serialization.decode(bytes(blob), "model-a", tokens)
    assert header.num_tokens == 7 and header.tensors[0].dtype == str(dtype).removeprefix("torch.")
    for (k, v), (dk, dv) in zip(layers, decoded):
        assert torch.equal(k, dk) and torch.equal(v, dv)
    # the tensor bytes (64-byte aligned) plus a small header
    assert len(blob) - header.payload_bytes < 4096
    assert sum(k.nbytes + v.nbytes for k, v in layers) <= header.payload_bytes < sum(k.nbytes + v.nbytes for k, v in layers) + 64 * 6


def test_prefix_of_history_is_accepted():
    blob = serialization.encode(_layers(), "m", list(range(7)))
    serialization.decode(blob, "m", list(range(7)) + [1, 2, 3])


@pytest.mark.parametrize(
    "mutate, model, tokens, message",
    [
        (lambda b: b.__setitem__(len(b) - 3, b[len(b) - 3] ^ 0xFF), "m", list(range(7)), "payload checksum"),
        (lambda b: b.__setitem__(30, b[30] ^ 0x01), "m", list(range(7)), "header checksum"),
        (lambda b: b.__setitem__(4, 1), "m", list(range(7)), "format version"),
        (lambda b: b.__setitem__(slice(0, 4), b"XXXX"), "m", list(range(7)), "not a statekeeper"),
        (lambda b: b.__setitem__(4, 9), "m", list(range(7)), "format version"),
        (lambda b: None, "other-model", list(range(7)), "another model"),
        (lambda b: None, "m", [9] * 7, "tokens"),
        (lambda b: None, "m", list(range(5)), "tokens"),
        (lambda b: b.__delitem__(slice(len(b) - 8, len(b))), "m", list(range(7)), "size"),
    ],
)
def test_bad_blobs_are_refused(mutate, model, tokens, message):
    blob = serialization.encode(_layers(), "m", list(range(7)))
    mutate(blob)
    with pytest.raises(BlobError, match=message):
        serialization.decode(blob, model, tokens)


def test_truncated_prefix_is_refused():
    with pytest.raises(BlobError):
        serialization.decode(b"SKKV", "m", [])


def test_named_tensors_of_any_dtype_roundtrip():
    tensors = [("codes", torch.randint(0, 255, (3, 5), dtype=torch.uint8)), ("mask", torch.tensor([True, False])),
               ("empty", torch.zeros(0, 4)), ("scale", torch.randn(3, 1).half())]
    blob = serialization.encode_tensors(tensors, "m", [1, 2, 3], 3, meta={"codec": "int8"})
    header, decoded = serialization.decode_tensors(blob, "m", [1, 2, 3])
    assert header.meta == {"codec": "int8"}
    for name, tensor in tensors:
        assert torch.equal(decoded[name], tensor)


@pytest.mark.parametrize("field, value", [("dtype", ["f"]), ("shape", "12"), ("shape", [1.5]), ("offset", "0"),
                                          ("nbytes", None), ("name", 7)])
def test_a_header_with_a_valid_checksum_and_fields_of_the_wrong_type_is_refused(field, value):
    """A forged header (its checksum recomputed): a BlobError, which every reader turns into a recompute, never
    a TypeError (a 500 where the header alone is read: the conversation's view)."""
    import json
    import struct

    import xxhash

    entry = {"name": "0.k", "dtype": "float32", "shape": [1], "offset": 0, "nbytes": 4} | {field: value}
    header = json.dumps({"model": "m", "num_tokens": 1, "tokens_digest": "", "tensors": [entry], "meta": {},
                         "payload_bytes": 64, "payload_checksum": ""}).encode()
    prefix = struct.pack("<4sHHIQ", serialization.MAGIC, serialization.FORMAT_VERSION, 0, len(header),
                         xxhash.xxh3_64_intdigest(header))
    with pytest.raises(BlobError):
        serialization.read_header(prefix + header + bytes(64))
