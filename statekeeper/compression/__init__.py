"""KV compression methods, one small dataclass each (kvpress style). A method turns a conversation's
per-layer (K, V) into what would be stored, and back into KV the model can attend to; `stored_bytes`
says what the stored form costs. Methods that need attention statistics get them in `compress`."""

from statekeeper.compression.base import Compressed, KVCompressor, NoCompression
from statekeeper.compression.quantized import QuantizedKV

__all__ = ["Compressed", "KVCompressor", "NoCompression", "QuantizedKV", "by_name"]


def by_name(name: str) -> KVCompressor:
    methods = {
        "none": NoCompression(),
        "int8": QuantizedKV(bits=8),
        "int4": QuantizedKV(bits=4),
    }
    if name not in methods:
        raise ValueError(f"unknown compression {name!r}; known: {', '.join(methods)}")
    return methods[name]
