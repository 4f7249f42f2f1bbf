"""KV compression methods, one small dataclass each (kvpress style), registered by name
(compression/registry.py). A method turns a conversation's per-layer (K, V) into what would be stored, and
restores what it stored into KV the model can attend to; `stored_bytes` says what the stored form costs, and
the form (compression/form.py) what the blob holds. Methods that need attention statistics get them in
`compress`.

Order of application: a method decides which vectors are stored (cross-layer sharing, per-head
eviction); the codec (compression/codec.py) then decides how each stored vector is written."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statekeeper.compression import codec as codecs
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, KVCompressor, Layers, NoCompression
from statekeeper.compression.eviction import H2OEviction
from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.registry import MethodSpec, method_class, policy_class, registered, restorer
from statekeeper.compression.shared_heads import SharedHeadEviction
from statekeeper.compression.sharing import CrossLayerSharing

__all__ = ["Compressed", "CrossLayerSharing", "H2OEviction", "HeadBudgetEviction", "KVCompressor", "NoCompression",
           "SharedHeadEviction", "StoredForm", "WithCodec", "by_name", "from_config", "registered", "restore_state"]


def layer_tensors(layers: Layers) -> list[tuple[str, torch.Tensor]]:
    return [item for i, (k, v) in enumerate(layers) for item in ((f"{i}.k", k), (f"{i}.v", v))]


def restore_state(tensors: dict[str, torch.Tensor], meta: dict | StoredForm, num_layers: int
                  ) -> tuple[Layers, list | None]:
    """A stored state's tensors back to (dense layers, per-head attention bias or None): the codec's codes
    decoded, then the restore of the method registered for the blob's form. Raises KeyError/ValueError/
    RuntimeError when the tensors do not fit the description."""
    form = meta if isinstance(meta, StoredForm) else StoredForm.from_meta(meta)
    if form.codec is not None:
        tensors = codecs.decode(tensors, form.codec)
    return restorer(form)(tensors, form, num_layers)


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
        form = inner.form.with_codec(quant)
        named = dict(stored)

        def rebuild() -> Layers:
            return restore_state(named, form, len(layers))[0]

        return Compressed(rebuild(), sum(t.nbytes for _, t in stored), inner.keep, form, stored, rebuild,
                          inner.head_bias)


def _method(spec: str, ratio: float, gamma: float, rankings: dict | None, profile=None) -> KVCompressor:
    """`spec` without codec: `<name>[-<option>...][@<own>]` built by the method registered for `<name>`;
    `<sharing>/<per-head>` composes the two (compression/shared_heads.py)."""
    if "/" in spec:
        share_spec, _, heads_spec = spec.partition("/")
        return SharedHeadEviction.compose(spec, _method(share_spec, ratio, gamma, rankings),
                                          _method(heads_spec, ratio, gamma, rankings, profile))
    parsed = MethodSpec.parse(spec, ratio=ratio, gamma=gamma, rankings=rankings, profile=profile)
    return method_class(parsed).from_spec(parsed)


def by_name(name: str, ratio: float = 0.2, gamma: float = 0.6, rankings: dict | None = None,
            profile=None) -> KVCompressor:
    """Methods by name, e.g. `krul-kv@0.4`, `expected-merge@0.25+int4`, `int8` (= `none+int8`).
    `damage` methods need `rankings` keyed by what they share ("v", "k", "kv"), `-calibrated` ones a
    HeadProfile (statekeeper/compression/head_profile.py); both are measured by
    statekeeper/evaluation/calibration.py."""
    spec, _, codec_name = name.partition("+")
    if spec.startswith("int") and not codec_name:
        spec, codec_name = "none", spec
    codec = codecs.by_name(codec_name or "none")
    if spec.partition("@")[0] in ("hetero", "hetero-exact", "hetero-global", "hetero-global-prompt",
                                    "hetero-global-prompt-static"):
        return _hetero(name, spec, codec, profile)
    method = _method(spec, ratio, gamma, rankings, profile)
    return method if codec is None else WithCodec(name, method, codec)


def _hetero(name: str, spec: str, codec, profile) -> KVCompressor:
    """`hetero[-exact|-global|-global-prompt[-static]][@<fallback keep>][+<codec>]`: HeteroCache with the
    taxonomy of `profile` (a HeadProfile that `statekeeper calibrate --taxonomy` measured); -exact: the working
    set's rows from the exact copy; -global: the fast copy and the working set (at the taxonomy's live share,
    exact rows) by KVzip scores with global budgets, no head whole, the taxonomy's clusters only for retrieval;
    -global-prompt: that, with the turn's prompt prefilled on the exact copy and the reply on the working set;
    -static: that without retrieval (the service's COMPRESSION_LIVE_KEEP with an exact copy)."""
    from statekeeper.compression.hetero import HeteroCache
    from statekeeper.compression.taxonomy import HeadTaxonomy

    if profile is None or getattr(profile, "taxonomy", None) is None:
        raise ValueError(f"{name!r} needs a head profile with a taxonomy (statekeeper calibrate --taxonomy)")
    head, _, fallback = spec.partition("@")
    taxonomy = HeadTaxonomy.from_dict(profile.taxonomy)
    method = HeteroCache.build(name, taxonomy, float(fallback or 0.34), codec, exact_rows=head == "hetero-exact")
    if head.startswith("hetero-global"):  # the fast copy by global budgets too; the working set at live_rho, exact
        from statekeeper.compression.head_budget import HeadBudgetEviction

        fast = HeadBudgetEviction("kvzip-global", "kvzip", float(fallback or 0.34), "global")
        method.fast = fast if codec is None else WithCodec(name, fast, codec)
        method.live_selection = HeadBudgetEviction("kvzip-global", "kvzip", taxonomy.live_rho, "global")
        method.prompt_exact = head.startswith("hetero-global-prompt")
        method.retrieve = not head.endswith("-static")
    return method


def from_config(config, profile=None) -> KVCompressor | None:
    """The compressor a session's CompressionConfig asks for, built by the method registered for its policy;
    None stores the KV as it is. `profile`: the calibrated HeadProfile for the config's scorer, if any."""
    method = None if config.policy == "none" else policy_class(config.policy).from_config(config, profile)
    codec = codecs.by_name(config.codec, config.group_size)
    if codec is None:
        return method
    return WithCodec(f"{config.policy}+{config.codec}", method or NoCompression(), codec)
