"""KV compression methods, one small dataclass each (kvpress style). A method turns a conversation's
per-layer (K, V) into what would be stored, and back into KV the model can attend to; `stored_bytes`
says what the stored form costs. Methods that need attention statistics get them in `compress`."""

from statekeeper.compression.base import Compressed, KVCompressor, NoCompression
from statekeeper.compression.eviction import H2OEviction
from statekeeper.compression.quantized import QuantizedKV
from statekeeper.compression.sharing import CrossLayerSharing

__all__ = ["Compressed", "CrossLayerSharing", "H2OEviction", "KVCompressor", "NoCompression", "QuantizedKV",
           "by_name"]


def by_name(name: str, ratio: float = 0.2, gamma: float = 0.6) -> KVCompressor:
    """Methods by name; `-kv` / `-k` suffixes share keys and values / keys only (default: values)."""
    base, _, parts = name.partition("-")
    shares = {"": (False, True), "v": (False, True), "k": (True, False), "kv": (True, True)}
    if parts not in shares:
        raise ValueError(f"unknown compression {name!r}")
    keys, values = shares[parts]
    simple = {"none": NoCompression(), "int8": QuantizedKV(bits=8), "int4": QuantizedKV(bits=4), "h2o": H2OEviction()}
    if base in simple:
        return simple[base]
    if base in ("krul", "krul_fixed", "minicache"):
        return CrossLayerSharing(name, base, ratio, gamma, share_keys=keys, share_values=values)
    raise ValueError(f"unknown compression {name!r}")


def from_config(config) -> KVCompressor | None:
    """The compressor a session's CompressionConfig asks for; None stores the KV as it is."""
    if config.policy == "none":
        return None
    return CrossLayerSharing(config.policy, config.policy, config.ratio, config.gamma, config.t, config.retain_angle,
                             config.share_keys, config.share_values)
