"""Per-tier codecs: a blob that lands in a tier with a codec is re-encoded with it (storage/manager.py
calls the transcoder; it only sees bytes).

A tier's codec is a ceiling on precision: blobs written with no codec, or with more bits than the
tier's, are re-encoded (dequantized first, so int8 -> int4 quantizes the int8 values once more);
blobs already at the tier's bits or fewer stay as written, since more bits would only add bytes. What
the blob stores besides K and V rows (per-head indices, sharing's norms, the meta describing them) is
kept; the model fingerprint and token digest stay the blob's own."""

from __future__ import annotations

from dataclasses import dataclass

from statekeeper.compression import codec as codecs
from statekeeper.compression.form import StoredForm
from storage import serialization

_K_OR_V = (".k", ".v")


def _bits(codec_name: str) -> int:
    codec = codecs.by_name(codec_name)
    return 64 if codec is None else codec.total_bits


def effective_codec(written: str, tier_codec: str) -> str:
    """The codec a blob written with `written` has once it sits in a tier whose codec is `tier_codec`."""
    return tier_codec if _bits(tier_codec) < _bits(written) else written


@dataclass(frozen=True, slots=True)
class Transcoder:
    codec: str  # the tier's codec name (compression/codec.py)

    def __call__(self, blob):
        header, _ = serialization.read_header(blob)
        form = StoredForm.from_meta(header.meta)
        quant, written = form.codec, form.codec_name
        if effective_codec(written, self.codec) == written:
            return blob
        header, tensors = serialization.decode_any(blob)
        if quant:
            tensors = codecs.decode(tensors, quant)
        head_dim = next((t.shape[-1] for name, t in tensors.items() if name.endswith(_K_OR_V) and t.dim()), None)
        if head_dim is None:
            return blob  # no K or V rows: nothing to re-encode
        stored, new_quant = codecs.by_name(self.codec).encode(list(tensors.items()), head_dim)
        return serialization.reencode_tensors(header, stored, form.with_codec(new_quant).to_meta())
