"""Offline calibration of cross-layer sharing: which layer pairs this model can share cheaply.

Each candidate pair is shared alone on calibration conversations that the evaluation does not use; its
damage is the mean KL(full || shared) per teacher-forced assistant token. The issue's probe found that on
SmolLM2 the damage depends on which layers share (12-23 fragile) far more than on how alike their
attention maps are, so a ranking measured once per model is a candidate replacement for Krul's per-
conversation similarity ranking (Krul §5, Algorithm 1)."""

from __future__ import annotations

from statekeeper.compression import CrossLayerSharing
from statekeeper.fidelity import ContinuationCase, FidelityTotals, build_state, compare_continuation
from statekeeper.worker import ModelWorker

Pair = tuple[int, int]


def adjacent_pairs(num_layers: int) -> list[Pair]:
    return [(layer, layer + 1) for layer in range(num_layers - 1)]


def pair_damage(worker: ModelWorker, cases: list[ContinuationCase], parts: list[str],
                candidates: list[Pair] | None = None, log=print) -> dict[str, list[tuple[Pair, float]]]:
    """For each of `parts` ("v", "k", "kv": what the pair shares), candidates sorted by mean KL, least
    damaging first. One state per case serves every candidate."""
    candidates = candidates or adjacent_pairs(worker.num_layers)
    totals = {(part, pair): FidelityTotals() for part in parts for pair in candidates}
    for index, case in enumerate(cases):
        state = build_state(worker, case.history[:-1])
        for part, pair in totals:
            probe = CrossLayerSharing(f"pair{pair}-{part}", "fixed", share_keys="k" in part,
                                      share_values="v" in part, pairs=[pair])
            totals[part, pair].add(compare_continuation(worker, case.history, case.continuation, case.spans,
                                                        probe, state))
        log(f"calibration: conversation {index + 1}/{len(cases)}")
    return {part: sorted(((pair, totals[part, pair].mean_kl) for pair in candidates), key=lambda item: item[1])
            for part in parts}
