"""The compression interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import torch

from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.form import StoredForm
from statekeeper.compression.registry import MethodSpec, register

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [kv_heads, tokens, head_dim]


def layers_nbytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


@dataclass(slots=True)
class Compressed:
    layers: Layers  # what the model attends to after a restore
    stored_bytes: int  # what the stored form costs
    keep: torch.Tensor | None = None  # [tokens] bool: history tokens still attended (eviction methods)
    form: StoredForm = field(default_factory=StoredForm)  # what the stored tensors hold: the blob's meta
    tensors: list | None = None  # the stored form as named tensors, where it differs from `layers`
    rebuild: Callable[[], Layers] | None = None  # stored form -> attended layers (what a restore runs)
    head_bias: list[torch.Tensor] | None = None  # per layer [kv_heads, tokens] (per-head eviction, merged votes)
    # Per stored tensor name, the method's score of each of its rows (not stored): per-head eviction's
    # scores of the entries it kept, which a codec may use to write the top-scored rows more precisely.
    row_scores: dict[str, torch.Tensor] | None = None
    working_set: object = None  # HeteroCache (compression/hetero.py): the exact copy and its drift monitor

    def restore(self) -> Layers:
        return self.rebuild() if self.rebuild is not None else self.layers

    @property
    def meta(self) -> dict:
        """The blob meta the stored form is written with."""
        return self.form.to_meta()


class KVCompressor(Protocol):
    name: str

    def compress(self, layers: Layers, stats: AttentionStats | None = None,
                 bias: list[torch.Tensor] | None = None) -> Compressed:
        """`bias`: the per-head attention bias already in effect on these layers (a state restored from
        per-head eviction); a method that cannot carry it forward raises ValueError."""
        ...


@register
@dataclass(slots=True)
class NoCompression:
    """The state as it is; its form ("exact") is also what going inactive stores before any compression,
    with the per-head attention bias of a state restored from per-head eviction."""

    name: str = "none"
    spec_names: ClassVar = ("none", "")
    policies: ClassVar = ("none",)
    form: ClassVar = "exact"

    @classmethod
    def from_spec(cls, spec: MethodSpec) -> NoCompression:
        return cls()

    @classmethod
    def from_config(cls, config, profile=None) -> NoCompression:
        return cls()

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias=None) -> Compressed:
        refuse_bias(self.name, bias)
        return Compressed(layers, layers_nbytes(layers))

    @staticmethod
    def restore(tensors: dict[str, torch.Tensor], form: StoredForm, num_layers: int) -> tuple[Layers, list | None]:
        layers = [(tensors[f"{i}.k"], tensors[f"{i}.v"]) for i in range(num_layers)]
        if form.window_starts:
            if len(form.window_starts) != num_layers:
                raise ValueError("the blob's window starts do not name every layer")
            layers = [(_after_zeros(k, start), _after_zeros(v, start)) for (k, v), start in zip(layers, form.window_starts)]
        return layers, [tensors[f"{i}.bias"] for i in range(num_layers)] if form.bias else None


def _after_zeros(rows: torch.Tensor, start: int) -> torch.Tensor:
    """A sliding-window layer's stored rows [heads, window, dim] back at their positions, after `start` zero
    rows: rows no later token attends to (its window mask hides them; zeros, not garbage, since a zero
    attention weight does not hide a NaN)."""
    if start == 0:
        return rows
    return torch.cat([rows.new_zeros(rows.shape[0], start, rows.shape[2]), rows], dim=1)


def refuse_bias(name: str, bias) -> None:
    if bias is not None:
        raise ValueError(f"{name} cannot keep a per-head attention bias")
