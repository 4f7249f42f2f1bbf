"""Cross-layer KV sharing: pairs of layers store one merged direction per token (kernels/slerp.py).

Pair selection is where the methods differ:
- MiniCache (fixed): adjacent pairs from the last layer down.
- Krul (Fix): adjacent pairs inside the I-R layers, from the lowest I-R layer up (Krul §8, Table 4).
- Krul (adaptive, Algorithm 1): non-I-R layers excluded (mean attention on the initial and recent 10%
  of positions below gamma), I-R layer pairs sorted by the distance of their attention maps, disjoint
  pairs taken greedily until the shared layers (both layers of a pair count, as in Algorithm 1's S)
  reach r_l of all layers.
- Damage (calibrated): candidate pairs ranked once per model by the KL they cause on calibration
  conversations when shared alone (statekeeper/evaluation/calibration.py); the least damaging
  disjoint pairs are taken until the shared layers reach r_l. The issue's probe found damage depends
  on which layers far more than on attention similarity.
- Fixed pairs.
Keys and values are merged separately (`share_keys`, `share_values`): merging keys across layers is
known to hurt modern models more than merging values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kernels.slerp import MergedPair, slerp_merge, unmerge
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers, refuse_bias
from statekeeper.compression.form import StoredForm
from statekeeper.compression.registry import MethodSpec, register

# `-kv` / `-k` / `-v` (or nothing): what a pair shares, (keys, values)
_SHARES = {(): (False, True), ("v",): (False, True), ("k",): (True, False), ("kv",): (True, True)}


def _num_pairs(ratio: float, num_layers: int) -> int:
    return int(ratio * num_layers) // 2


def minicache_pairs(num_layers: int, ratio: float) -> list[tuple[int, int]]:
    return [(num_layers - 2 * k - 2, num_layers - 2 * k - 1) for k in range(_num_pairs(ratio, num_layers))]


def ir_layers(stats: AttentionStats, gamma: float) -> list[int]:
    return [layer for layer, score in enumerate(stats.ir_scores().tolist()) if score >= gamma]


def krul_fixed_pairs(stats: AttentionStats, ratio: float, gamma: float) -> list[tuple[int, int]]:
    eligible = set(ir_layers(stats, gamma))
    pairs, layer = [], 0
    while layer < stats.num_layers - 1 and len(pairs) < _num_pairs(ratio, stats.num_layers):
        if layer in eligible and layer + 1 in eligible:
            pairs.append((layer, layer + 1))
            layer += 2
        else:
            layer += 1
    return pairs


def least_damage_pairs(ranking: list[tuple[int, int]], ratio: float, num_layers: int) -> list[tuple[int, int]]:
    """Disjoint pairs in ranking order (least damaging first) until r_l of the layers share."""
    pairs, used = [], set()
    for i, j in ranking:
        if len(pairs) == _num_pairs(ratio, num_layers):
            break
        if i not in used and j not in used:
            pairs.append((i, j))
            used.update((i, j))
    return sorted(pairs)


def krul_pairs(stats: AttentionStats, ratio: float, gamma: float) -> list[tuple[int, int]]:
    """Krul Algorithm 1 (lines 1-22)."""
    eligible = ir_layers(stats, gamma)
    distances = stats.distances()
    candidates = sorted(
        ((float(distances[i, j]), j, i) for a, i in enumerate(eligible) for j in eligible[a + 1 :]),
    )
    pairs, used = [], set()
    for _, i, j in candidates:
        if 2 * len(pairs) >= int(ratio * stats.num_layers) - 1:
            break
        if i in used or j in used:
            continue
        pairs.append((min(i, j), max(i, j)))
        used.update((i, j))
    return sorted(pairs)


@register
@dataclass(slots=True)
class CrossLayerSharing:
    name: str
    selection: str = "krul"  # krul | krul_fixed | minicache | damage | fixed
    ratio: float = 0.2  # r_l: fraction of layers that share
    gamma: float = 0.6  # I-R threshold
    t: float = 0.5  # SLERP interpolation
    retain_angle: float = 0.5  # tokens further apart than this fraction of pi stay unmerged
    share_keys: bool = False
    share_values: bool = True
    pairs: list[tuple[int, int]] = field(default_factory=list)  # selection == "fixed"
    ranking: list[tuple[int, int]] = field(default_factory=list)  # selection == "damage": least damaging first
    spec_names: ClassVar = ("krul", "krul_fixed", "minicache", "damage")
    policies: ClassVar = ("krul", "krul_fixed", "minicache")
    form: ClassVar = "sharing"

    @classmethod
    def from_spec(cls, spec: MethodSpec) -> CrossLayerSharing:
        """`<selection>[-kv|-k|-v][@<r_l>]`; `damage` needs the caller's rankings for what it shares."""
        if spec.options not in _SHARES:
            raise ValueError(f"unknown compression {spec.text!r}")
        keys, values = _SHARES[spec.options]
        ratio = float(spec.own) if spec.own else spec.ratio
        if spec.head != "damage":
            return cls(spec.text, spec.head, ratio, spec.gamma, share_keys=keys, share_values=values)
        part = "".join(spec.options) or "v"
        if part not in (spec.rankings or {}):
            raise ValueError(f"{spec.text!r} needs a damage ranking for {part!r}")
        return cls(spec.text, "damage", ratio, spec.gamma, share_keys=keys, share_values=values,
                   ranking=spec.rankings[part])

    @classmethod
    def from_config(cls, config, profile=None) -> CrossLayerSharing:
        return cls(config.policy, config.policy, config.ratio, config.gamma, config.t, config.retain_angle,
                   config.share_keys, config.share_values)

    @staticmethod
    def restore(tensors: dict[str, torch.Tensor], form: StoredForm, num_layers: int) -> tuple[Layers, None]:
        return reconstruct(tensors, form.pairs, form.parts, num_layers), None

    def select(self, stats: AttentionStats | None, num_layers: int) -> list[tuple[int, int]]:
        if self.selection == "minicache":
            return minicache_pairs(num_layers, self.ratio)
        if self.selection == "fixed":
            return list(self.pairs)
        if self.selection == "damage":
            if not self.ranking:
                raise ValueError(f"{self.name} needs a calibrated damage ranking")
            return least_damage_pairs(self.ranking, self.ratio, num_layers)
        if stats is None:
            raise ValueError(f"{self.name} needs attention statistics")
        if self.selection == "krul_fixed":
            return krul_fixed_pairs(stats, self.ratio, self.gamma)
        return krul_pairs(stats, self.ratio, self.gamma)

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias=None) -> Compressed:
        refuse_bias(self.name, bias)
        pairs = self.select(stats, len(layers))
        parts = [index for index, on in ((0, self.share_keys), (1, self.share_values)) if on]
        merged = {(i, j, part): slerp_merge(layers[i][part], layers[j][part], self.t, self.retain_angle)
                  for i, j in pairs for part in parts}
        result = [list(pair) for pair in layers]
        for (i, j, part), pair in merged.items():
            result[i][part], result[j][part] = unmerge(pair)
        tensors = self._stored_tensors(layers, merged)
        form = StoredForm("sharing", self.name, pairs=tuple(tuple(pair) for pair in pairs), parts=tuple(parts))
        return Compressed([(k, v) for k, v in result], sum(t.nbytes for _, t in tensors), form=form,
                          tensors=tensors, rebuild=lambda: reconstruct(dict(tensors), form.pairs, form.parts,
                                                                       len(layers)))

    @staticmethod
    def _stored_tensors(layers: Layers, merged: dict) -> list:
        shared = {(i, part) for i, _, part in merged} | {(j, part) for _, j, part in merged}
        tensors = [(f"{i}.{'kv'[part]}", layers[i][part]) for i in range(len(layers)) for part in (0, 1)
                   if (i, part) not in shared]
        for (i, j, part), pair in merged.items():
            tensors += pair.tensors(f"{i}+{j}.{'kv'[part]}")
        return tensors


def reconstruct(tensors: dict, pairs, parts, num_layers: int) -> Layers:
    """Rebuilds every layer's K and V from a stored shared state (see CrossLayerSharing.compress)."""
    result = [[tensors.get(f"{i}.k"), tensors.get(f"{i}.v")] for i in range(num_layers)]
    for i, j in pairs:
        for part in parts:
            result[i][part], result[j][part] = unmerge(MergedPair.from_tensors(tensors, f"{i}+{j}.{'kv'[part]}"))
    return [(k, v) for k, v in result]
