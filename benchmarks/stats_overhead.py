"""Cost of gathering Krul's attention statistics during generation: decode time per token with and
without statistics, prefill time, and statistics memory next to the conversation's KV size.

    python -m benchmarks.stats_overhead --threads 1 --lengths 1000,2000 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.harness import StreamedTable, add_model_arguments, load_worker
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.worker import ModelWorker


def history_tokens(worker: ModelWorker, length: int) -> list[int]:
    text = " ".join(content for conversation in sharegpt_conversations(min_turns=2) for _, content in conversation)
    return worker.tokenizer(text[: length * 8], add_special_tokens=False)["input_ids"][:length]


def timed_decode(worker, cache, steps, stats) -> list[float]:
    times, token = [], 13
    for _ in range(steps):
        started = time.perf_counter()
        logits = worker.decode(cache, token, stats)
        times.append((time.perf_counter() - started) * 1000)
        token = int(logits.argmax())
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    worker = load_worker(args)
    table = StreamedTable(["history", "prefill ms (no stats / stats)", "decode ms/token (no stats / stats)",
                           "decode slowdown", "stats bytes", "KV bytes", "stats / KV"])
    for length in (int(x) for x in args.lengths.split(",")):
        tokens = history_tokens(worker, length)
        samples = {"plain": [], "stats": [], "prefill_plain": [], "prefill_stats": []}
        stats_bytes = kv_bytes = 0
        for round_index in range(args.rounds):
            for mode in (("plain", "stats") if round_index % 2 == 0 else ("stats", "plain")):
                stats = worker.new_stats() if mode == "stats" else None
                cache = worker.new_cache()
                started = time.perf_counter()
                worker.prefill(cache, tokens, stats)
                samples[f"prefill_{mode}"].append((time.perf_counter() - started) * 1000)
                samples[mode] += timed_decode(worker, cache, args.steps, stats)
                if stats is not None:
                    stats_bytes = stats.nbytes
                    kv_bytes = sum(k.nbytes + v.nbytes for k, v in cache.export_layers())
        # Mean, not median: statistics are sampled every few decode steps, so the cost sits in a minority of steps.
        plain, with_stats = statistics.fmean(samples["plain"]), statistics.fmean(samples["stats"])
        table.row([length, f"{statistics.median(samples['prefill_plain']):.0f} / "
                           f"{statistics.median(samples['prefill_stats']):.0f}", f"{plain:.2f} / {with_stats:.2f}",
                   f"{(with_stats / plain - 1) * 100:+.1f}%", f"{stats_bytes:,}", f"{kv_bytes:,}",
                   f"{stats_bytes / kv_bytes:.4f}"])


if __name__ == "__main__":
    main()
