"""The dashboard's forecast (issue 32): the service's own recent turns replayed through the simulator with its
tiers' budgets scaled, its placement policy and its cost profile: what more (or less) storage would do to the
hit rate and the first tokens of the traffic it actually has."""

from __future__ import annotations

from collections.abc import Sequence

from statekeeper.placement.costs import CostProfile
from statekeeper.placement.trace import TraceTurn
from statekeeper.simulation.simulator import SimulationConfig, hit_rate, simulate

MULTIPLES = (0.5, 1.0, 2.0, 4.0)


def forecast(turns: Sequence[TraceTurn], tiers: list[tuple[str, int]], costs: CostProfile, policy: str,
             compression: str, idle_offload_s: float, compress_after_s: float,
             multiples: Sequence[float] = MULTIPLES) -> list[dict]:
    """One row per multiple of every tier's budget: its hit rate (resumed turns that did not recompute), where
    resumed turns found their KV, the recomputed tokens and the estimated first tokens."""
    rows = []
    for multiple in multiples:
        scaled = [(name, max(1, int(budget * multiple))) for name, budget in tiers]
        report = simulate(turns, SimulationConfig(scaled, costs, idle_offload_s, policy, compression, compress_after_s))
        rows.append({"multiple": multiple, "tiers": dict(scaled), "resumed": dict(report.resumed),
                     "hit_rate": hit_rate(report.resumed),
                     "recomputed_tokens": report.recomputed_tokens,
                     "first_token_ms_p50": round(report.first_token_percentile(0.5), 1),
                     "first_token_ms_p95": round(report.first_token_percentile(0.95), 1)})
    return rows
