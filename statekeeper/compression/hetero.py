"""HeteroCache (../shared/papers/001): a small fast copy, the exact state one tier down, and a live working set
built from both, with retrieval when attention drifts.

The fast copy is per-head eviction (KVzip scores) with per-head budgets from the head taxonomy
(compression/taxonomy.py): anchors and satellites keep their live budgets, pivots and volatile heads the
`fallback` share (what a restore without the exact copy attends to), then the integer codec. It is a plain
"heads" blob: without the exact copy it restores as today's static compression does.

The working set a restore builds: the fast copy, with pivot and volatile heads replaced by their exact rows;
at most `live_rho` of the history's (head, token) entries attended before any retrieval. The DriftMonitor
(compression/retrieval.py) then brings satellites' entries back from the exact copy when their pivot drifts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.base import Compressed, Layers
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.retrieval import DriftMonitor
from statekeeper.compression.taxonomy import HeadTaxonomy


@dataclass(frozen=True, slots=True)
class WorkingSet:
    """What a hetero restore hands the live cache, beyond the layers and bias Compressed carries."""

    exact: Layers  # the exact copy (here: in memory; in the service: read from its tier)
    monitor: DriftMonitor
    live_entries: int  # attended (head, history token) entries before any retrieval
    entries: int  # all of them
    # The turn's prompt attends the exact copy in full (read whole before its prefill ends, which the restore
    # plan allows where the copy's tier is fast enough); only the reply attends the working set
    prompt_exact: bool = False
    # The monitor's drifts bring rows back (False: the working set stays as the restore built it, which is what
    # the service's COMPRESSION_LIVE_KEEP with an exact copy does)
    retrieve: bool = True


@dataclass(slots=True)
class HeteroCache:
    name: str
    taxonomy: HeadTaxonomy
    fast: object  # the fast copy's compressor: HeadBudgetEviction, or it within WithCodec
    scorer: str = "kvzip"
    # The working set's rows of the compressed heads: read from the exact copy at the fast copy's positions
    # (True), or the fast copy's own (quantized by its codec)
    exact_rows: bool = False
    # Where the working set's positions come from instead of the taxonomy's budgets: this selection (e.g. KVzip
    # scores with global budgets at live_rho), with exact rows and no head kept whole
    live_selection: HeadBudgetEviction | None = None
    # WorkingSet.prompt_exact: the prompt's prefill on the exact copy, the working set from the reply on (the
    # new question is where attention drifts most; its own rows then hold what it read of the whole history)
    prompt_exact: bool = False
    retrieve: bool = True  # WorkingSet.retrieve

    @classmethod
    def build(cls, name: str, taxonomy: HeadTaxonomy, fallback: float, codec=None, scorer: str = "kvzip",
              exact_rows: bool = False) -> "HeteroCache":
        """`codec`: the fast copy's integer codec (compression/codec.py), None for none."""
        from statekeeper.compression import WithCodec

        budgets = [[fallback if role in ("pivot", "volatile") else budget
                    for role, budget in zip(roles, layer_budgets)]
                   for roles, layer_budgets in zip(taxonomy.roles, taxonomy.live_budgets)]
        eviction = HeadBudgetEviction(f"{scorer}-taxonomy@{fallback:g}", scorer, fallback, "calibrated",
                                      profile=budgets)
        return cls(name, taxonomy, eviction if codec is None else WithCodec(name, eviction, codec), scorer,
                   exact_rows)

    def compress(self, layers: Layers, stats: AttentionStats | None = None, bias=None) -> Compressed:
        if bias is not None:
            raise ValueError(f"{self.name} compresses exact states only")
        if stats is None or any(q is None for q in stats.recent_queries):
            raise ValueError(f"{self.name} needs the recent queries of the attention statistics")
        if self.prompt_exact and not (self.exact_rows or self.live_selection is not None):
            raise ValueError(f"{self.name}: an exact prompt needs a working set of exact rows")
        fast = self.fast.compress(layers, stats)
        scaling = layers[0][0].shape[-1] ** -0.5
        monitor = DriftMonitor.start(self.taxonomy, layers, stats.recent_queries, scaling)
        if self.live_selection is None:
            live, live_bias = self.working_set(fast.restore(), fast.head_bias, layers)
        else:  # no head kept whole: a drifting pivot brings rows back to itself too
            live, live_bias = layers, self.live_selection.compress(layers, stats).head_bias
            monitor.whole = frozenset()
        live_entries = sum(int(torch.isfinite(b).sum()) for b in live_bias)
        entries = sum(b.numel() for b in live_bias)
        return Compressed(live, fast.stored_bytes, form=fast.form, tensors=fast.tensors, head_bias=live_bias,
                          row_scores=fast.row_scores, working_set=WorkingSet(layers, monitor, live_entries, entries,
                                                                   self.prompt_exact, self.retrieve))

    def working_set(self, fast_layers: Layers, fast_bias: list[torch.Tensor], exact: Layers
                    ) -> tuple[Layers, list[torch.Tensor]]:
        """The fast copy's layers and bias with every full head's rows exact and attended."""
        live, bias = [], []
        for layer, ((keys, values), layer_bias, (exact_keys, exact_values)) in enumerate(zip(fast_layers, fast_bias,
                                                                                             exact)):
            full = self.taxonomy.full_heads(layer)
            if self.exact_rows:
                keys, values = exact_keys, exact_values
            keys, values, layer_bias = keys.clone(), values.clone(), layer_bias.clone()
            keys[full], values[full] = exact_keys[full].to(keys.dtype), exact_values[full].to(values.dtype)
            layer_bias[full] = 0.0
            live.append((keys, values))
            bias.append(layer_bias)
        return live, bias
