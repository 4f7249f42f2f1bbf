"""How much a warm CPU cache flatters a tier probe (issue 6): the same SmolLM2-shaped stored state loaded
into a fresh cache through the restore pipeline's loader (r = 0), median of 5 after one untimed read,
(a) back to back as the probe did before run 9, (b) each after writing 256 MB, (c) each after a
300-token prefill, as a restore follows a turn's work, (d) back to back again.

    python -m benchmarks.probe_cache_state --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import StreamedTable, add_model_arguments, load_worker
from scheduler.plan import RestorePlan
from statekeeper.restore_pipeline import restore_pipelined
from storage import serialization
from storage.dram import DramTier


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="573,1009,2048")
    args = parser.parse_args()
    worker = load_worker(args)
    tier, flush = DramTier(1 << 40), torch.empty(256 << 20, dtype=torch.uint8)
    table = StreamedTable(["tokens", "back to back ms", "after writing 256 MB ms", "after a 300-token prefill ms",
                           "back to back again ms"])
    for tokens in [int(x) for x in args.lengths.split(",")]:
        history = list(range(tokens))
        shape = (worker.num_kv_heads, tokens, worker.head_dim)
        layers = [(torch.randn(shape, dtype=worker.dtype), torch.randn(shape, dtype=worker.dtype))
                  for _ in range(worker.num_layers)]
        tier.put("probe", serialization.encode(layers, worker.fingerprint, history))

        def load_ms() -> float:
            with tier.read("probe") as view:
                _, stored = serialization.decode(view, worker.fingerprint, history)
                started = time.perf_counter()
                restore_pipelined(worker, stored, history, RestorePlan(tokens, 0, 0.0, 0.0))
                return (time.perf_counter() - started) * 1e3

        def before(mode: str, attempt: int) -> None:
            if mode == "flush":
                flush.fill_(attempt)
            elif mode == "prefill":
                worker.prefill(worker.new_cache(), list(range(100, 400)))

        cells = []
        for mode in ("hot", "flush", "prefill", "hot"):
            times = []
            for attempt in range(6):
                before(mode, attempt)
                times.append(load_ms())
            cells.append(statistics.median(times[1:]))
        table.row([tokens, *(f"{ms:.2f}" for ms in cells)])


if __name__ == "__main__":
    main()
