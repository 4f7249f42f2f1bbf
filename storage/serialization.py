"""KV blob format, kept separate from the tiers that move the bytes.

    offset 0   magic b"SKKV" | u16 format version | u16 reserved | u32 header length | u64 xxh3(header)
    offset 20  header: UTF-8 JSON (model fingerprint, dtype, shapes, token count and digest, payload xxh3)
    aligned    payload: for each layer, K [kv_heads, tokens, head_dim] then V, contiguous, native dtype

No pickle: the header is JSON and the payload raw little-endian tensor bytes. Decoding returns views into
the buffer (no copy); every check runs before a single byte reaches the model."""

from __future__ import annotations

import json
import struct
import warnings
from array import array
from dataclasses import asdict, dataclass

import torch
import xxhash

MAGIC = b"SKKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")
_ALIGN = 64
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class BlobError(ValueError):
    """The blob cannot be used: corrupt, another format version, another model, or other tokens."""


def tokens_digest(tokens: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(array("i", tokens).tobytes())


@dataclass(slots=True)
class BlobHeader:
    model: str
    dtype: str
    num_layers: int
    kv_heads: int
    key_dim: int
    value_dim: int
    num_tokens: int
    tokens_digest: str
    payload_bytes: int
    payload_checksum: str = ""

    @property
    def layer_bytes(self) -> tuple[int, int]:
        item = _DTYPES[self.dtype].itemsize
        per_token = self.kv_heads * self.num_tokens * item
        return per_token * self.key_dim, per_token * self.value_dim


def _payload_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // _ALIGN) * _ALIGN


def encode(layers: list[tuple[torch.Tensor, torch.Tensor]], model: str, tokens: list[int]) -> bytearray:
    """Packs per-layer (K, V) of shape [kv_heads, tokens, dim] into one buffer with a single copy."""
    keys0, values0 = layers[0]
    dtype_name = next(name for name, dt in _DTYPES.items() if dt == keys0.dtype)
    header = BlobHeader(
        model=model,
        dtype=dtype_name,
        num_layers=len(layers),
        kv_heads=keys0.shape[0],
        key_dim=keys0.shape[-1],
        value_dim=values0.shape[-1],
        num_tokens=keys0.shape[1],
        tokens_digest=tokens_digest(tokens[: keys0.shape[1]]),
        payload_bytes=sum(k.nbytes + v.nbytes for k, v in layers),
    )
    # The header is written after the payload checksum is known; reserve its final length now.
    header.payload_checksum = "0" * 16
    offset = _payload_offset(len(json.dumps(asdict(header)).encode()))
    blob = bytearray(offset + header.payload_bytes)
    payload = memoryview(blob)[offset:]
    cursor = 0
    for keys, values in layers:
        for tensor in (keys, values):
            target = torch.frombuffer(payload, dtype=keys0.dtype, count=tensor.numel(), offset=cursor)
            target.view(tensor.shape).copy_(tensor)
            cursor += tensor.nbytes
    header.payload_checksum = xxhash.xxh3_64_hexdigest(payload)
    header_bytes = json.dumps(asdict(header)).encode()
    assert _payload_offset(len(header_bytes)) == offset
    blob[: _PREFIX.size] = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header_bytes), xxhash.xxh3_64_intdigest(header_bytes))
    blob[_PREFIX.size : _PREFIX.size + len(header_bytes)] = header_bytes
    return blob


def read_header(blob) -> tuple[BlobHeader, int]:
    view = memoryview(blob)
    if len(view) < _PREFIX.size:
        raise BlobError("blob shorter than its prefix")
    magic, version, _, header_len, header_hash = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise BlobError("not a statekeeper KV blob")
    if version != FORMAT_VERSION:
        raise BlobError(f"blob format version {version}, expected {FORMAT_VERSION}")
    header_bytes = bytes(view[_PREFIX.size : _PREFIX.size + header_len])
    if len(header_bytes) != header_len or xxhash.xxh3_64_intdigest(header_bytes) != header_hash:
        raise BlobError("blob header checksum mismatch")
    try:
        header = BlobHeader(**json.loads(header_bytes))
    except (TypeError, ValueError) as exc:
        raise BlobError(f"unreadable blob header: {exc}") from exc
    if header.dtype not in _DTYPES:
        raise BlobError(f"unknown dtype {header.dtype}")
    return header, _payload_offset(header_len)


def decode(blob, model: str, tokens: list[int]) -> tuple[BlobHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Validates the blob against the model and the conversation's token history; returns zero-copy views."""
    header, offset = read_header(blob)
    if header.model != model:
        raise BlobError("blob was computed by another model")
    if header.num_tokens > len(tokens) or tokens_digest(tokens[: header.num_tokens]) != header.tokens_digest:
        raise BlobError("blob does not match the conversation's tokens")
    payload = memoryview(blob)[offset:]
    key_bytes, value_bytes = header.layer_bytes
    if len(payload) != header.payload_bytes or header.payload_bytes != header.num_layers * (key_bytes + value_bytes):
        raise BlobError("blob payload has the wrong size")
    if xxhash.xxh3_64_hexdigest(payload) != header.payload_checksum:
        raise BlobError("blob payload checksum mismatch")
    dtype = _DTYPES[header.dtype]
    key_shape = (header.kv_heads, header.num_tokens, header.key_dim)
    value_shape = (header.kv_heads, header.num_tokens, header.value_dim)
    layers = []
    cursor = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers (LMDB pages) are only ever copied from
        for _ in range(header.num_layers):
            keys = torch.frombuffer(payload, dtype=dtype, count=key_bytes // dtype.itemsize, offset=cursor)
            cursor += key_bytes
            values = torch.frombuffer(payload, dtype=dtype, count=value_bytes // dtype.itemsize, offset=cursor)
            cursor += value_bytes
            layers.append((keys.view(key_shape), values.view(value_shape)))
    return header, layers
