"""What KVzip scoring costs on the model thread next to a plain prefill of the same history (issue 13,
"cheaper to make").

Histories are the fidelity harness's ShareGPT states (statekeeper/evaluation/teacher_forcing.py
`sharegpt_cases`: the history after the first turn that reaches about each --lengths target), the first
--conversations of them per length. For each history, every round, in an order that rotates from round
to round:
- prefill: the history into a fresh cache (ModelWorker.prefill, the worker's prefill chunks);
- each --variants scoring, run the way the service runs it (Compactor._reconstruction_scores:
  reconstruction_plan with --job-tokens per step, every step, then the cache cropped back):
  `reference` is the scoring before issue 13 (attention_stats.ReconstructionScores: SDPA, then q·Kᵀ and a
  softmax again for every query row; the whole history repeated at once); `fused-c<N>[-int8]` is
  compression/reconstruction.py: one attention, the history repeated N tokens at a time (`-c0`: all at
  once), the scoring forward's linears in int8 (ReconstructionScoring.by_name).
Times are CPU seconds of this process (time.process_time; one torch thread), so another job on the cores
inflates them less than wall time. Reported per variant and length: CPU seconds per 1k history tokens
(median over histories and rounds) and the ratio to the prefill (median of per-history, per-round ratios:
the two ran side by side), and the kept-set overlap with the reference's scores at the default keep
(per-head eviction with Ada-KV budgets: |kept ∩ kept_reference| / |kept_reference|), a cheap first look at
whether the scores still choose the same entries (the fidelity harness is the real test).

    python -m benchmarks.scoring_cost --threads 1 --lengths 1000,2000 --conversations 3 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from benchmarks.harness.machine import commit
from statekeeper.chat import ChatFormatter
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.reconstruction import REFERENCE_SCORING, ReconstructionScoring
from statekeeper.config import CompressionConfig, SessionConfig
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.evaluation.teacher_forcing import sharegpt_cases
from statekeeper.worker import ModelWorker

def histories(worker: ModelWorker, lengths: list[int], count: int) -> list[tuple[int, list[int]]]:
    formatter, end_of_turn = ChatFormatter(worker.tokenizer), worker.tokenizer.eos_token_id
    picked = []
    for length in lengths:
        cases = sharegpt_cases(formatter, sharegpt_conversations(min_turns=4), length, count, end_of_turn)
        picked += [(length, case.history[:-1]) for case in cases]
    return picked


def cpu_seconds(run) -> tuple[float, object]:
    started = time.process_time()
    result = run()
    return time.process_time() - started, result


def kept_overlap(scores: list[torch.Tensor], reference: list[torch.Tensor], keep: float) -> float:
    method = HeadBudgetEviction("overlap", "kvzip", keep)
    kept = both = 0
    for mine, theirs in zip(scores, reference):
        a, b = method.select(mine, None), method.select(theirs, None)
        kept += int(b.sum())
        both += int((a & b).sum())
    return both / max(1, kept)


def measure(worker: ModelWorker, history: list[int], variants: list[str], rounds: int, job_tokens: int,
            keep: float) -> list[dict]:
    rows = []
    cache = worker.new_cache()
    worker.prefill(cache, history)
    reference = worker.reconstruction_scores(cache, history, REFERENCE_SCORING, job_tokens)
    probes = ["prefill"] + variants
    for round_index in range(rounds):
        shift = round_index % len(probes)
        seconds, overlaps = {}, {}
        for probe in probes[shift:] + probes[:shift]:
            if probe == "prefill":
                seconds[probe], _ = cpu_seconds(lambda: worker.prefill(worker.new_cache(), history))
            else:
                seconds[probe], scores = cpu_seconds(
                    lambda: worker.reconstruction_scores(cache, history, ReconstructionScoring.by_name(probe), job_tokens))
                overlaps[probe] = kept_overlap(scores, reference, keep)
        for variant in variants:
            rows.append({"tokens": len(history), "round": round_index, "variant": variant,
                         "prefill_s": seconds["prefill"], "scoring_s": seconds[variant],
                         "ratio": seconds[variant] / seconds["prefill"], "kept_overlap": overlaps[variant]})
    return rows


def summarize(rows: list[dict], lengths: list[int], variants: list[str]) -> str:
    table = []
    for length in lengths:
        for variant in variants:
            mine = [r for r in rows if r["length"] == length and r["variant"] == variant]
            if not mine:
                continue
            tokens = statistics.mean(r["tokens"] for r in mine)
            table.append([f"~{length:,} ({tokens:.0f})", variant, len(mine),
                          f"{statistics.median(1000 * r['prefill_s'] / r['tokens'] for r in mine):.2f}",
                          f"{statistics.median(1000 * r['scoring_s'] / r['tokens'] for r in mine):.2f}",
                          f"{statistics.median(r['ratio'] for r in mine):.2f}×",
                          f"{statistics.mean(r['kept_overlap'] for r in mine):.4f}"])
    return markdown_table(["history (mean tokens)", "scoring", "runs", "prefill CPU s / 1k tokens",
                           "scoring CPU s / 1k tokens", "scoring / prefill", "kept-set overlap with reference"], table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--conversations", type=int, default=3, help="histories per length")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="reference,fused-c0,fused-c0-int8,fused-c512-int8")
    parser.add_argument("--job-tokens", type=int, default=SessionConfig().compress_chunk_tokens,
                        help="tokens per scoring step (the service's compress_chunk_tokens)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    worker = load_worker(args)
    lengths = [int(x) for x in args.lengths.split(",")]
    variants = args.variants.split(",")
    for name in variants:
        ReconstructionScoring.by_name(name)
    keep = CompressionConfig().keep
    worker.prefill(worker.new_cache(), list(range(100, 400)))  # warm up
    rows = []
    for length, history in histories(worker, lengths, args.conversations):
        for row in measure(worker, history, variants, args.rounds, args.job_tokens, keep):
            rows.append(row | {"length": length})
        print(f"length {length}: {len(history)} tokens done", file=sys.stderr, flush=True)
    print(f"commit {commit()}, {machine_line()}, "
          f"torch {torch.__version__}, {args.threads} thread(s), {args.job_tokens} tokens per scoring step")
    print(summarize(rows, lengths, variants))
    if args.json:
        write_json(args.json, {"rows": rows, "args": vars(args)})


if __name__ == "__main__":
    main()
