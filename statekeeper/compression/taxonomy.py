"""HeteroCache's head taxonomy (../shared/papers/001, §3): which KV heads keep their full history in the live
cache, which share one head's attention, and what the compressed ones may keep.

Measured offline (statekeeper/evaluation/calibration.py `calibrate_taxonomy`) from each head's top-k attended
history positions: its *stability* (overlap of the positions it attends while the conversation goes on with
those it attended when the history ended) and each pair of heads' *similarity* (overlap of their positions at
the same steps). Heads of one layer that attend alike form clusters by greedy star clustering: the head most
similar to the rest is the *pivot*, the heads similar to it its *satellites*. A head in no cluster is an
*anchor* when stable, else *volatile*. Pivots and volatile heads keep everything live (a pivot's attention
is what tells its satellites what to bring back when it drifts: compression/retrieval.py); anchors and
satellites share the rest of the live budget in inverse proportion to their stability (eq. 7-8: a head that
moves more gets more).

Overlap coefficient of two position sets: |A ∩ B| / min(|A|, |B|) (eq. 2)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

ROLES = ("pivot", "satellite", "anchor", "volatile")
FULL_ROLES = ("pivot", "volatile")  # kept whole in the live cache


def overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """Overlap coefficient of two sets of positions (1-D tensors without repeats)."""
    if not len(a) or not len(b):
        return 0.0
    return len(set(a.tolist()) & set(b.tolist())) / min(len(a), len(b))


def attended(queries: torch.Tensor, keys: torch.Tensor, scaling: float, pool: int = 7) -> torch.Tensor:
    """[Hkv, n]: the attention each KV head's history positions get from `queries` [Hq, w, d] (post-RoPE, a
    GQA group of query heads per KV head, averaged over the group and the window, as the paper does (C.1)),
    smoothed over neighbouring positions by an average pool of width `pool` (a fact spans several tokens)."""
    kv_heads, tokens, dim = keys.shape
    q = queries.float().reshape(kv_heads, -1, dim)
    probs = torch.softmax(q @ keys.float().transpose(1, 2) * scaling, dim=-1).mean(dim=1)  # [Hkv, n]
    if pool > 1 and tokens >= pool:
        probs = torch.nn.functional.avg_pool1d(probs[:, None], pool, stride=1, padding=pool // 2,
                                               count_include_pad=False)[:, 0, :tokens]
    return probs


def top_positions(scores: torch.Tensor, k_fraction: float) -> list[torch.Tensor]:
    """Per head of `scores` [H, n], its top k = ceil(k_fraction * n) positions."""
    k = max(1, min(scores.shape[1], math.ceil(k_fraction * scores.shape[1])))
    return list(scores.topk(k, dim=1).indices)


@dataclass(slots=True)
class Cluster:
    layer: int
    pivot: int
    satellites: list[int]


@dataclass(slots=True)
class HeadTaxonomy:
    """The roles, clusters and live budgets of one model's KV heads, and the settings they were measured with
    (the drift check uses the same window, pool and k). Stored in the head profile (head_profile.py)."""

    stability: list[list[float]]  # [L][H]: median overlap with the head's own positions at the history's end
    pair_overlap: list[list[list[float]]]  # [L][H][H]: median overlap of two heads' positions at the same steps
    roles: list[list[str]]  # [L][H]: ROLES
    clusters: list[Cluster]
    live_budgets: list[list[float]]  # [L][H]: the fraction of the history each head keeps live (1.0: all)
    live_rho: float  # the live budget over all heads
    tau_stable: float = 0.5
    tau_sim: float = 0.5
    tau_drift: float = 0.5  # a pivot whose positions overlap its baseline less than this has drifted
    k_fraction: float = 0.1
    pool: int = 7
    window: int = 16  # queries per check
    samples: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "HeadTaxonomy":
        data = dict(data)
        data["clusters"] = [Cluster(**cluster) for cluster in data["clusters"]]
        taxonomy = cls(**data)
        if any(role not in ROLES for layer in taxonomy.roles for role in layer):
            raise ValueError(f"a head's role is one of {', '.join(ROLES)}")
        return taxonomy

    def full_heads(self, layer: int) -> list[int]:
        return [head for head, role in enumerate(self.roles[layer]) if role in FULL_ROLES]

    def counts(self) -> dict[str, int]:
        return {role: sum(layer.count(role) for layer in self.roles) for role in ROLES}


def star_clusters(pair_overlap: list[list[float]], tau_sim: float) -> list[tuple[int, list[int]]]:
    """Greedy star clustering of one layer's heads (paper C.2): while two unassigned heads are similar, the
    one similar to the most others (ties: the larger summed similarity) is a pivot and those similar to it
    its satellites. (pivot, satellites) per cluster."""
    heads = len(pair_overlap)
    unassigned, clusters = set(range(heads)), []
    while True:
        neighbours = {h: [o for o in unassigned if o != h and pair_overlap[h][o] >= tau_sim] for h in unassigned}
        candidates = [h for h in unassigned if neighbours[h]]
        if not candidates:
            return clusters
        pivot = max(candidates, key=lambda h: (len(neighbours[h]), sum(pair_overlap[h][o] for o in neighbours[h]),
                                               -h))
        clusters.append((pivot, sorted(neighbours[pivot])))
        unassigned -= {pivot, *neighbours[pivot]}


def build_taxonomy(stability: list[list[float]], pair_overlap: list[list[list[float]]], live_rho: float,
                   tau_stable: float = 0.5, tau_sim: float = 0.5, **settings) -> HeadTaxonomy:
    """Roles by clustering and stability, then the live budgets: full heads 1.0, the rest share what is left
    of live_rho * heads by inverse stability (eq. 7-8), each at most 1.0 (the excess goes to the others).
    Raises ValueError when the full heads alone exceed the live budget."""
    roles, clusters = [], []
    for layer, (layer_stability, layer_pairs) in enumerate(zip(stability, pair_overlap)):
        layer_roles = ["anchor" if s >= tau_stable else "volatile" for s in layer_stability]
        for pivot, satellites in star_clusters(layer_pairs, tau_sim):
            clusters.append(Cluster(layer, pivot, satellites))
            layer_roles[pivot] = "pivot"
            for satellite in satellites:
                layer_roles[satellite] = "satellite"
        roles.append(layer_roles)
    budgets = _inverse_stability_budgets(stability, roles, live_rho)
    return HeadTaxonomy(stability, pair_overlap, roles, clusters, budgets, live_rho, tau_stable, tau_sim, **settings)


def _inverse_stability_budgets(stability: list[list[float]], roles: list[list[str]], live_rho: float
                               ) -> list[list[float]]:
    heads = [(layer, head) for layer, layer_roles in enumerate(roles) for head in range(len(layer_roles))]
    full = {(layer, head) for layer, head in heads if roles[layer][head] in FULL_ROLES}
    left = live_rho * len(heads) - len(full)
    if left < 0:
        raise ValueError(f"{len(full)} of {len(heads)} heads keep their whole history: more than a live budget "
                         f"of {live_rho:g}; raise it, or tau_sim / lower tau_stable")
    budgets = {key: 1.0 for key in full}
    open_heads = [key for key in heads if key not in full]
    while open_heads:  # water-filling: a head capped at 1.0 hands its excess to the others
        weights = {key: 1.0 / max(stability[key[0]][key[1]], 0.05) for key in open_heads}
        total = sum(weights.values())
        shares = {key: left * weight / total for key, weight in weights.items()}
        capped = [key for key, share in shares.items() if share >= 1.0]
        if not capped:
            budgets |= shares
            break
        for key in capped:
            budgets[key] = 1.0
            left -= 1.0
            open_heads.remove(key)
    return [[budgets[(layer, head)] for head in range(len(layer_roles))] for layer, layer_roles in enumerate(roles)]
