"""HeteroCache's retrieval (../shared/papers/001, §4 and Algorithm 1): a restored working set keeps pivot and
volatile heads whole and the others compressed; when a pivot's attention drifts away from what it attended
when the history ended, its satellites get the history entries the pivot now attends to, exact, from the
exact copy one tier down.

`DriftMonitor` is an attention collector (compression/attention_stats.py `collecting`): it keeps the last
`window` queries of each pivot's GQA group, which is all a check needs. `check(layers)` compares each pivot's
top-k attended positions with its baseline (overlap coefficient below tau_drift: drift) and returns the rows
its cluster's heads lack exact; KVCache.write_rows writes them into the live cache and lets those heads attend
to them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from statekeeper.compression.taxonomy import HeadTaxonomy, attended, overlap, top_positions


@dataclass(slots=True)
class Retrieval:
    layer: int
    head: int
    positions: torch.Tensor  # history positions this head did not attend to yet


@dataclass(slots=True)
class RetrievalCounters:
    checks: int = 0
    drift_events: int = 0
    retrievals: int = 0  # (satellite, check) pairs that brought rows back
    rows: int = 0
    bytes: int = 0  # what the rows read from the exact copy (keys and values)


@dataclass(slots=True)
class DriftMonitor:
    taxonomy: HeadTaxonomy
    history_tokens: int
    scaling: float
    query_groups: int  # query heads per KV head
    baseline: dict[tuple[int, int], torch.Tensor]  # (layer, pivot) -> its top-k positions when last checked
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [pivots * group, <= window, d]
    # (layer, satellite) -> [history] bool: rows it holds exact (retrieved); the rest are evicted, or kept in
    # the compressed form's precision (the large-margin misses of a compressed state sit on quantized keys of
    # the fact tokens: BENCHMARKS.md, "Where the ~2k recall errors come from"), so both are retrieved.
    exact: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    whole: frozenset = frozenset()  # (layer, head) kept whole and exact in the working set: never retrieved for
    # (the taxonomy's pivots and volatile heads, unless the working set keeps none whole)
    counters: RetrievalCounters = field(default_factory=RetrievalCounters)

    @classmethod
    def start(cls, taxonomy: HeadTaxonomy, layers: list, recent_queries: list, scaling: float) -> "DriftMonitor":
        """Baselines from the queries that ended the history (AttentionStats.recent_queries) over the exact
        keys of `layers` (the pivots are whole in the live cache, so their keys are exact there too)."""
        kv_heads = layers[0][0].shape[0]
        groups = recent_queries[0].shape[0] // kv_heads
        monitor = cls(taxonomy, layers[0][0].shape[1], scaling, groups, {})
        monitor.whole = frozenset((layer, head) for layer in range(len(layers)) for head in taxonomy.full_heads(layer))
        for cluster in taxonomy.clusters:
            queries = monitor._group(recent_queries[cluster.layer], [cluster.pivot])[:, -taxonomy.window :]
            keys = layers[cluster.layer][0][cluster.pivot : cluster.pivot + 1]
            monitor.baseline[(cluster.layer, cluster.pivot)] = monitor._positions(queries, keys)
        return monitor

    def _group(self, queries: torch.Tensor, heads: list[int]) -> torch.Tensor:
        """The query heads of KV heads `heads` (GQA: query head h * groups + g reads KV head h)."""
        rows = [h * self.query_groups + g for h in heads for g in range(self.query_groups)]
        return queries[rows]

    def _positions(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        scores = attended(queries, keys[:, : self.history_tokens], self.scaling, self.taxonomy.pool)
        return top_positions(scores, self.taxonomy.k_fraction)[0]

    # -- the attention hook (collecting(monitor)) ------------------------------------------------------

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        pivots = [c.pivot for c in self.taxonomy.clusters if c.layer == layer]
        if not pivots:
            return
        recent = self._group(query[0], pivots)[:, -self.taxonomy.window :].to(torch.float16)
        previous = self.queries.get(layer)
        if previous is not None and recent.shape[1] < self.taxonomy.window:
            recent = torch.cat([previous, recent], dim=1)[:, -self.taxonomy.window :]
        self.queries[layer] = recent

    # -- the check and the retrieval --------------------------------------------------------------------

    def check(self, cache_layers: list) -> list[Retrieval]:
        """Per drifted pivot, the positions its cluster's heads (those not kept whole) should hold exact and do
        not: the pivot's current top-k, less what they retrieved before (counted as retrieved: the caller
        writes them). `cache_layers`: (K, V) per layer holding the pivots' exact keys (the live cache, where
        pivots are kept whole; else the exact copy)."""
        wanted = []
        self.counters.checks += 1
        for cluster in self.taxonomy.clusters:
            queries = self.queries.get(cluster.layer)
            if queries is None or not cluster.satellites:
                continue
            index = [c.pivot for c in self.taxonomy.clusters if c.layer == cluster.layer].index(cluster.pivot)
            group = queries[index * self.query_groups : (index + 1) * self.query_groups]
            keys = cache_layers[cluster.layer][0][cluster.pivot : cluster.pivot + 1]
            current = self._positions(group, keys)
            key = (cluster.layer, cluster.pivot)
            if overlap(current, self.baseline[key]) >= self.taxonomy.tau_drift:
                continue
            self.counters.drift_events += 1
            self.baseline[key] = current
            for head in (cluster.pivot, *cluster.satellites):
                if (cluster.layer, head) in self.whole:
                    continue
                exact = self.exact.setdefault((cluster.layer, head), torch.zeros(self.history_tokens, dtype=torch.bool))
                positions = current[~exact[current]]
                if len(positions):
                    exact[positions] = True
                    wanted.append(Retrieval(cluster.layer, head, positions))
        self.counters.retrievals += len(wanted)
        self.counters.rows += sum(len(r.positions) for r in wanted)
        return wanted
