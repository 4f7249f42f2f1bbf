"""KV blob format, kept separate from the tiers that move the bytes.

    offset 0   magic b"SKKV" | u16 format version | u16 reserved | u32 header length | u64 xxh3(header)
    offset 20  header: UTF-8 JSON: model fingerprint, token count and digest, the tensor table
               (name, dtype, shape, offset, size), free-form `meta` (e.g. the compression used), and the
               payload's xxh3 checksum
    aligned    payload: the tensors, raw little-endian bytes, each 64-byte aligned

A plain state is the tensors "<layer>.k" and "<layer>.v" ([kv_heads, tokens, head_dim]); compressed
states add their own tensors and describe them in `meta`. No pickle. Decoding returns views into the
buffer (no copy); every check runs before a single byte reaches the model."""

from __future__ import annotations

import json
import struct
import warnings
from array import array
from dataclasses import asdict, dataclass, field

import torch
import xxhash

MAGIC = b"SKKV"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<4sHHIQ")
_ALIGN = 64
_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class BlobError(ValueError):
    """The blob cannot be used: corrupt, another format version, another model, or other tokens."""


class BlobMismatch(BlobError):
    """A sound blob of another model or other tokens than the reader's: the reader's view may be the stale one
    (a replica behind the shared history, one of the old version in a rolling upgrade)."""


def tokens_digest(tokens: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(array("i", tokens).tobytes())


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


@dataclass(slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass(slots=True)
class BlobHeader:
    model: str
    num_tokens: int
    tokens_digest: str
    tensors: list[TensorEntry]
    meta: dict = field(default_factory=dict)
    payload_bytes: int = 0
    payload_checksum: str = ""


def encode_tensors(tensors: list[tuple[str, torch.Tensor]], model: str, tokens: list[int], num_tokens: int,
                   meta: dict | None = None) -> bytearray:
    """Packs named tensors into one buffer with a single copy of each."""
    return _encode(tensors, model, num_tokens, tokens_digest(tokens[:num_tokens]), meta)


def reencode_tensors(header: "BlobHeader", tensors: list[tuple[str, torch.Tensor]], meta: dict) -> bytearray:
    """A new blob for the same model and tokens as `header` (a transcoded blob), with other tensors."""
    return _encode(tensors, header.model, header.num_tokens, header.tokens_digest, meta)


def _encode(tensors: list[tuple[str, torch.Tensor]], model: str, num_tokens: int, digest: str,
            meta: dict | None) -> bytearray:
    entries, offset = [], 0
    for name, tensor in tensors:
        offset = _aligned(offset)
        entries.append(TensorEntry(name, _NAMES[tensor.dtype], list(tensor.shape), offset, tensor.nbytes))
        offset += tensor.nbytes
    header = BlobHeader(model, num_tokens, digest, entries, meta or {}, offset, "0" * 16)
    payload_at = _aligned(_PREFIX.size + len(_header_bytes(header)))  # the checksum has a fixed width
    blob = bytearray(payload_at + offset)
    payload = memoryview(blob)[payload_at:]
    for entry, (_, tensor) in zip(entries, tensors):
        if tensor.nbytes:
            target = torch.frombuffer(payload, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
            target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    header.payload_checksum = xxhash.xxh3_64_hexdigest(payload)
    header_bytes = _header_bytes(header)
    blob[: _PREFIX.size] = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header_bytes), xxhash.xxh3_64_intdigest(header_bytes))
    blob[_PREFIX.size : _PREFIX.size + len(header_bytes)] = header_bytes
    return blob


def _header_bytes(header: BlobHeader) -> bytes:
    return json.dumps(asdict(header)).encode()


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


def _well_typed(header: BlobHeader) -> bool:
    texts = (header.model, header.tokens_digest, header.payload_checksum)
    return (all(isinstance(text, str) for text in texts) and _is_count(header.num_tokens)
            and _is_count(header.payload_bytes) and isinstance(header.meta, dict) and all(
                isinstance(entry.name, str) and isinstance(entry.dtype, str) and _is_count(entry.offset)
                and _is_count(entry.nbytes) and isinstance(entry.shape, list) and all(map(_is_count, entry.shape))
                for entry in header.tensors))


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
        raw = json.loads(header_bytes)
        raw["tensors"] = [TensorEntry(**entry) for entry in raw["tensors"]]
        header = BlobHeader(**raw)
    except (TypeError, ValueError, KeyError) as exc:
        raise BlobError(f"unreadable blob header: {exc}") from exc
    if not _well_typed(header):  # a forged header's checksum holds too
        raise BlobError("blob header fields of the wrong type")
    for entry in header.tensors:
        if entry.dtype not in _DTYPES:
            raise BlobError(f"unknown dtype {entry.dtype}")
        expected = _DTYPES[entry.dtype].itemsize
        for size in entry.shape:
            expected *= size
        if expected != entry.nbytes or entry.offset + entry.nbytes > header.payload_bytes or entry.offset % _ALIGN:
            raise BlobError(f"tensor {entry.name} does not fit its declared shape")
    return header, _aligned(_PREFIX.size + header_len)


def decode_tensors(blob, model: str, tokens: list[int]) -> tuple[BlobHeader, dict[str, torch.Tensor]]:
    """Validates the blob against the model and the conversation's token history; returns zero-copy views."""
    header, offset = read_header(blob)
    if header.model != model:
        raise BlobMismatch("blob was computed by another model")
    if header.num_tokens > len(tokens) or tokens_digest(tokens[: header.num_tokens]) != header.tokens_digest:
        raise BlobMismatch("blob does not match the conversation's tokens")
    return header, _payload_tensors(blob, header, offset)


def decode_any(blob) -> tuple[BlobHeader, dict[str, torch.Tensor]]:
    """The blob's tensors whatever model and tokens it belongs to (checksums still checked): for
    transcoding a blob between tiers, never for serving it."""
    header, offset = read_header(blob)
    return header, _payload_tensors(blob, header, offset)


def _payload_tensors(blob, header: BlobHeader, offset: int) -> dict[str, torch.Tensor]:
    payload = memoryview(blob)[offset:]
    if len(payload) != header.payload_bytes:
        raise BlobError("blob payload has the wrong size")
    if xxhash.xxh3_64_hexdigest(payload) != header.payload_checksum:
        raise BlobError("blob payload checksum mismatch")
    tensors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers (LMDB pages) are only ever copied from
        # One tensor over the payload, every entry a view of it: tensors lying back to back in the blob are
        # then one block of memory (a GPU restore copies a group of layers' tensors in one go).
        whole = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else None
    for entry in header.tensors:
        dtype = _DTYPES[entry.dtype]
        if entry.nbytes == 0:
            tensors[entry.name] = torch.empty(entry.shape, dtype=dtype)
            continue
        tensors[entry.name] = whole[entry.offset: entry.offset + entry.nbytes].view(dtype).view(entry.shape)
    return tensors


# -- plain (uncompressed) states -------------------------------------------------------------------

def layer_tensors(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    return [item for i, (k, v) in enumerate(layers) for item in ((f"{i}.k", k), (f"{i}.v", v))]


def encode(layers: list[tuple[torch.Tensor, torch.Tensor]], model: str, tokens: list[int],
           meta: dict | None = None) -> bytearray:
    return encode_tensors(layer_tensors(layers), model, tokens, layers[0][0].shape[1], meta)


def plain_layers(header: BlobHeader, tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    try:
        layers = [(tensors[f"{i}.k"], tensors[f"{i}.v"]) for i in range(len(tensors) // 2)]
    except KeyError as exc:
        raise BlobError(f"blob lacks tensor {exc}") from None
    if any(k.shape[1] != header.num_tokens or v.shape[1] != header.num_tokens for k, v in layers):
        raise BlobError("blob layers do not cover its token count")
    return layers


def decode(blob, model: str, tokens: list[int]) -> tuple[BlobHeader, list[tuple[torch.Tensor, torch.Tensor]]]:
    header, tensors = decode_tensors(blob, model, tokens)
    return header, plain_layers(header, tensors)
