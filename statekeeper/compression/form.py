"""What a stored blob's tensors hold and how they are read back: the blob meta as a typed, versioned
record. Every writer builds one (a compression method, the exact store, a tier's re-encode) and every reader
parses one, so no other code reads meta keys. Blobs written before the record had a version carry the same
keys without it; they are read as version 0."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

FORM_VERSION = 1
KINDS = ("exact", "sharing", "heads", "shared_heads")  # each restored by the method registered for it
_PARTS = {"exact": set(), "heads": set(), "sharing": {0, 1}, "shared_heads": {"k", "v"}}  # what pairs share


@dataclass(frozen=True, slots=True)
class StoredForm:
    kind: str = "exact"  # which registered restore rebuilds the layers (compression/registry.py)
    method: str | None = None  # the compression's name, as configured (informational)
    codec: dict | None = None  # the integer codec's description of its codes (compression/codec.py)
    bias: bool = False  # exact: the state came from per-head eviction and carries its attention bias
    num_tokens: int | None = None  # heads, shared_heads: the dense length the kept rows scatter into
    pairs: tuple[tuple[int, int], ...] = ()  # sharing, shared_heads: the layer pairs that share
    parts: tuple = ()  # ... and what they share (sharing: 0 keys / 1 values; shared_heads: "k" / "v")
    # exact: per layer, the first row stored (a sliding-window layer keeps only its window: the rows before it
    # are never attended again, and come back as zeros); () when every layer is whole
    window_starts: tuple[int, ...] = ()
    version: int = field(default=FORM_VERSION, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown stored form {self.kind!r}")
        if self.codec is not None and not isinstance(self.codec, dict):
            raise ValueError("a codec description is an object")
        if self.num_tokens is not None and (type(self.num_tokens) is not int or self.num_tokens < 0):
            raise ValueError("num_tokens is a count")
        if self.kind in ("heads", "shared_heads") and self.num_tokens is None:
            raise ValueError(f"a {self.kind} form needs num_tokens")
        if not all(len(pair) == 2 and all(type(i) is int and i >= 0 for i in pair) for pair in self.pairs):
            raise ValueError("pairs are pairs of layer indices")
        if not set(self.parts) <= _PARTS[self.kind]:
            raise ValueError(f"a {self.kind} form shares {set(_PARTS[self.kind]) or 'nothing'}")
        if self.window_starts and (self.kind != "exact" or self.bias
                                   or not all(type(i) is int and i >= 0 for i in self.window_starts)):
            raise ValueError("window starts are row counts, of an exact state without a bias")

    @property
    def is_compressed(self) -> bool:
        """Whether the blob holds less than the exact state (what the compactor needs not do again)."""
        return self.kind != "exact" or self.codec is not None

    @property
    def is_plain(self) -> bool:
        """The layers' K and V as they are, nothing else (what a planned restore streams layer by layer)."""
        return self.kind == "exact" and not self.bias and self.codec is None and not self.window_starts

    @property
    def codec_name(self) -> str:
        return self.codec["codec"] if self.codec else "none"

    def with_codec(self, codec: dict | None) -> StoredForm:
        return replace(self, codec=codec, version=FORM_VERSION)

    def to_meta(self) -> dict:
        meta = {"form": self.version, "kind": self.kind}
        for name, value in (("method", self.method), ("quant", self.codec), ("num_tokens", self.num_tokens)):
            if value is not None:
                meta[name] = value
        if self.bias:
            meta["bias"] = True
        if self.pairs:
            meta["pairs"], meta["parts"] = [list(pair) for pair in self.pairs], list(self.parts)
        if self.window_starts:
            meta["window_starts"] = list(self.window_starts)
        return meta

    @classmethod
    def from_meta(cls, meta: dict) -> StoredForm:
        """The record a blob's meta describes; ValueError for one that describes nothing readable."""
        if not isinstance(meta, dict):
            raise ValueError("blob meta is not an object")
        version = meta.get("form", 0)
        if version not in (0, FORM_VERSION):
            raise ValueError(f"stored form version {version!r} is not one this service reads")
        try:
            pairs = tuple(tuple(pair) for pair in meta.get("pairs") or ())
            parts = tuple(meta.get("parts") or ())
            window_starts = tuple(meta.get("window_starts") or ())
        except TypeError:
            raise ValueError("pairs are pairs of layer indices") from None
        kind = meta.get("kind") if version else _legacy_kind(meta)
        num_tokens = meta.get("num_tokens")
        return cls(kind=kind, method=meta.get("method"), codec=meta.get("quant"), bias=bool(meta.get("bias")),
                   num_tokens=num_tokens, pairs=pairs, parts=parts, window_starts=window_starts, version=version)


def _legacy_kind(meta: dict) -> str:
    """Blobs from before the version: the kind read from which keys the meta holds."""
    if meta.get("bias"):
        return "exact"
    if meta.get("heads"):
        return "shared_heads" if meta.get("pairs") else "heads"
    return "sharing" if meta.get("pairs") is not None else "exact"
