"""KV compression methods, one small dataclass each (kvpress style). A method turns a conversation's
per-layer (K, V) into what would be stored, and back into KV the model can attend to; `stored_bytes`
says what the stored form costs. Methods that need attention statistics get them in `compress`.

Order of application: a method decides which vectors are stored (cross-layer sharing, per-head
eviction); the codec (compression/codec.py) then decides how each stored vector is written."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statekeeper.compression import codec as codecs
from statekeeper.compression import head_budget, shared_heads, sharing
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, KVCompressor, Layers, NoCompression
from statekeeper.compression.eviction import H2OEviction
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.shared_heads import SharedHeadEviction
from statekeeper.compression.sharing import CrossLayerSharing

__all__ = ["Compressed", "CrossLayerSharing", "H2OEviction", "HeadBudgetEviction", "KVCompressor", "NoCompression",
           "SharedHeadEviction", "WithCodec", "by_name", "from_config", "restore_state"]


def layer_tensors(layers: Layers) -> list[tuple[str, torch.Tensor]]:
    return [item for i, (k, v) in enumerate(layers) for item in ((f"{i}.k", k), (f"{i}.v", v))]


def restore_state(tensors: dict[str, torch.Tensor], meta: dict, num_layers: int) -> tuple[Layers, list | None]:
    """A stored state's tensors back to (dense layers, per-head attention bias or None). Raises
    KeyError/ValueError/RuntimeError when the tensors do not fit the description."""
    if meta.get("bias"):  # an exact copy of a state restored from per-head eviction, with its bias
        return ([(tensors[f"{i}.k"], tensors[f"{i}.v"]) for i in range(num_layers)],
                [tensors[f"{i}.bias"] for i in range(num_layers)])
    if meta.get("quant") is not None:
        tensors = codecs.decode(tensors, meta["quant"])
    if meta.get("heads"):
        tensors = shared_heads.unshare(tensors, meta)  # per-head eviction, with or without shared pairs
        return head_budget.restore_layers(tensors, meta, num_layers), head_budget.restore_bias(tensors, meta, num_layers)
    if meta.get("pairs") is not None:
        return sharing.reconstruct(tensors, meta, num_layers), None
    return [(tensors[f"{i}.k"], tensors[f"{i}.v"]) for i in range(num_layers)], None


@dataclass(slots=True)
class WithCodec:
    """A method's stored form written with an integer codec (sharing or eviction first, then the codec)."""

    name: str
    inner: KVCompressor
    codec: codecs.IntCodec

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias: list | None = None) -> Compressed:
        inner = self.inner.compress(layers, stats, bias)
        stored, quant = self.codec.encode(inner.tensors or layer_tensors(layers), layers[0][0].shape[-1],
                                          inner.row_scores)
        meta = dict(inner.detail) | {"quant": quant}
        named = dict(stored)

        def rebuild() -> Layers:
            return restore_state(named, meta, len(layers))[0]

        return Compressed(rebuild(), sum(t.nbytes for _, t in stored), inner.keep, meta, stored, rebuild,
                          inner.head_bias)


def _method(spec: str, ratio: float, gamma: float, rankings: dict | None, profile=None) -> KVCompressor:
    """`spec` without codec: sharing methods take `-kv` / `-k` (share keys and values / keys only; default
    values) and `@r` (their r_l); per-head methods are `<scorer>[-uniform|-calibrated|-global][-merge]@<keep>`;
    `<sharing>/<per-head>` composes the two (compression/shared_heads.py)."""
    if "/" in spec:
        share_spec, _, heads_spec = spec.partition("/")
        share, evict = _method(share_spec, ratio, gamma, rankings), _method(heads_spec, ratio, gamma, rankings, profile)
        if not isinstance(share, CrossLayerSharing) or not isinstance(evict, HeadBudgetEviction):
            raise ValueError(f"{spec!r}: expected <sharing method>/<per-head method>")
        return SharedHeadEviction(spec, share, evict)
    base, _, own = spec.partition("@")
    head, *options = base.split("-")
    if head in ("none", ""):
        return NoCompression()
    if head == "h2o":
        return H2OEviction()
    if head in head_budget.SCORER_NAMES:
        unknown = set(options) - {"uniform", "calibrated", "global", "merge"}
        if unknown:
            raise ValueError(f"unknown options {sorted(unknown)} in {spec!r}")
        keep = float(own or 0.5)
        budgets = next((o for o in options if o in ("uniform", "calibrated", "global")), "adaptive")
        budget = None
        if budgets == "calibrated":
            budget = profile.budget_for(keep) if profile is not None and profile.scorer == head else None
            if budget is None:
                raise ValueError(f"{spec!r} needs a calibrated {head} profile with a budget for {keep:g}")
        return HeadBudgetEviction(spec, head, keep, budgets, profile=budget, merge="merge" in options)
    shares = {(): (False, True), ("v",): (False, True), ("k",): (True, False), ("kv",): (True, True)}
    if tuple(options) not in shares or head not in ("krul", "krul_fixed", "minicache", "damage"):
        raise ValueError(f"unknown compression {spec!r}")
    keys, values = shares[tuple(options)]
    ratio = float(own) if own else ratio
    if head == "damage":
        part = "".join(options) or "v"
        if part not in (rankings or {}):
            raise ValueError(f"{spec!r} needs a damage ranking for {part!r}")
        return CrossLayerSharing(spec, "damage", ratio, gamma, share_keys=keys, share_values=values,
                                 ranking=rankings[part])
    return CrossLayerSharing(spec, head, ratio, gamma, share_keys=keys, share_values=values)


def by_name(name: str, ratio: float = 0.2, gamma: float = 0.6, rankings: dict | None = None,
            profile=None) -> KVCompressor:
    """Methods by name, e.g. `krul-kv@0.4`, `expected-merge@0.25+int4`, `int8` (= `none+int8`).
    `damage` methods need `rankings` keyed by what they share ("v", "k", "kv"), `-calibrated` ones a
    HeadProfile (statekeeper/compression/head_profile.py); both are measured by
    statekeeper/evaluation/calibration.py."""
    spec, _, codec_name = name.partition("+")
    if spec.startswith("int") and not codec_name:
        spec, codec_name = "none", spec
    method = _method(spec, ratio, gamma, rankings, profile)
    codec = codecs.by_name(codec_name or "none")
    return method if codec is None else WithCodec(name, method, codec)


def from_config(config, profile=None) -> KVCompressor | None:
    """The compressor a session's CompressionConfig asks for; None stores the KV as it is. `profile`:
    the calibrated HeadProfile for the config's scorer, if any; calibrated budgets without a budget for
    `keep` fall back to uniform ones."""
    if config.policy == "none":
        method = None
    elif config.policy == "heads":
        budgets, budget = config.budgets, None
        if budgets == "calibrated":
            budget = profile.budget_for(config.keep) if profile is not None else None
            budgets = "calibrated" if budget is not None else "uniform"
        method = HeadBudgetEviction("heads", config.scorer, config.keep, budgets, profile=budget, merge=config.merge)
    else:
        method = CrossLayerSharing(config.policy, config.policy, config.ratio, config.gamma, config.t,
                                   config.retain_angle, config.share_keys, config.share_values)
    codec = codecs.by_name(config.codec, config.group_size)
    if codec is None:
        return method
    return WithCodec(f"{config.policy}+{config.codec}", method or NoCompression(), codec)
