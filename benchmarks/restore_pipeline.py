"""Resumed-turn TTFT with the recompute/load restore pipeline (issue 6), side by side in one run.

For histories of about 512, 1k, 2k and 4k tokens of real ShareGPT text (SmolLM2), the stored state sits
in DRAM, in LMDB (page cache warm), and in a tier whose reads are capped at 200 and 50 MB/s (benchmark
only: the loader sleeps to hold the cap, standing for a slow disk or network). Each resumed turn (a
real next user message) is timed to its first token for: full recompute, full load, fixed partial
recompute (half the tokens in every layer, as Cake and Pensieve split), and the planned split
(scheduler/plan.py with a profile measured at the start of this run). Reported per cell: median TTFT,
and for the planned split the plan's max(T_C, T_L) next to the measured restore and its bubble fraction.

    python -m benchmarks.restore_pipeline --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import StreamedTable, add_model_arguments, load_worker, machine_line
from scheduler.plan import LoadProfile, RestorePlan, StoredLayer, plan_restore
from statekeeper.chat import ChatFormatter
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.profile import FULL_LENGTHS, FULL_PROBE_TOKENS, measure_compute, measure_tier
from statekeeper.restore_pipeline import restore_pipelined
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier

TIERS = {"dram": None, "lmdb": None, "capped 200 MB/s": 200.0, "capped 50 MB/s": 50.0}


def histories(worker: ModelWorker, lengths: list[int]) -> dict[int, tuple[list[int], list[int]]]:
    """Per target length: a real history cut at a turn boundary near it, and the next user message. The
    shipped ShareGPT split cuts conversations at about 2k tokens, so consecutive conversations are
    chained into one long session (each starts with a user turn, so the roles still alternate)."""
    formatter, eos = ChatFormatter(worker.tokenizer), worker.tokenizer.eos_token_id
    found, tokens, session = {}, [], []
    for conversation in sharegpt_conversations(min_turns=4):
        messages = [{"role": role, "content": content} for role, content in conversation]
        for user, reply in zip(messages[::2], messages[1::2]):
            for length in lengths:
                if length not in found and 0.9 * length <= len(tokens) <= 1.3 * length:
                    prompt = formatter.extend(tokens, session + [user]).tokens
                    found[length] = (tokens, prompt[len(tokens):][:64])
            if len(found) == len(lengths):
                return found
            try:
                tokens, _ = formatter.append_turns(tokens, session, [user, reply], eos)
                session = session + [user, reply]
            except ValueError:  # a template that rewrites earlier turns: start a new session
                tokens, session = [], []
            if len(tokens) > 1.3 * max(set(lengths) - set(found)):  # overshot every missing length
                tokens, session = [], []
    raise ValueError(f"no histories for {sorted(set(lengths) - set(found))}")


def timed_turn(worker, restore, new_tokens) -> tuple[float, object]:
    started = time.perf_counter()
    cache, report = restore()
    worker.prefill(cache, new_tokens)  # the first token is sampled from these logits
    return (time.perf_counter() - started) * 1e3, report


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="512,1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    worker = load_worker(args)
    work = Path(tempfile.mkdtemp(prefix="statekeeper-pipeline-"))
    tiers = {"dram": DramTier(1 << 40), "lmdb": LmdbTier(work / "kv.lmdb", 8 << 30)}
    compute = measure_compute(worker, FULL_LENGTHS)
    loads = {name: measure_tier(tier, worker, FULL_PROBE_TOKENS) for name, tier in tiers.items()}
    for name, cap in TIERS.items():
        if cap is not None:  # the capped tier: LMDB's latency, the cap's bandwidth
            loads[name] = LoadProfile(loads["lmdb"].latency_ms, min(cap, loads["lmdb"].megabytes_per_s))
    print(f"machine: {machine_line()}, torch {torch.__version__}, "
          f"{args.threads} thread(s)")
    print(f"profile: recompute {compute.fixed_ms:.1f} ms + {compute.linear_ms:.3f} ms/token + "
          f"{compute.quadratic_ms:.2e} ms/token^2; "
          + "; ".join(f"{n}: {p.latency_ms:.2f} ms + {p.megabytes_per_s:.0f} MB/s" for n, p in loads.items()))
    print()
    table = StreamedTable(["history", "tier", "full recompute ms", "full load ms", "fixed half ms", "planned ms (r)",
                           "planned vs better extreme", "plan T_C / T_L ms", "measured T_C / T_L ms",
                           "plan max(T_C,T_L) ms", "measured restore ms", "bubble"])
    per_layer = [StoredLayer(2 * worker.num_kv_heads * worker.head_dim * worker.dtype.itemsize)] * worker.num_layers
    for length, (history, new_tokens) in histories(worker, [int(x) for x in args.lengths.split(",")]).items():
        cache = worker.new_cache()
        worker.prefill(cache, history)
        blob = serialization.encode(cache.export_layers(), worker.fingerprint, history)
        del cache
        for tier in tiers.values():
            tier.put("conversation", blob)
        n = len(history)
        recompute = statistics.median(
            timed_turn(worker, lambda: (_recomputed(worker, history), None), new_tokens)[0] for _ in range(args.rounds))
        for name, cap in TIERS.items():
            tier = tiers["lmdb" if cap is not None else name]
            plan = plan_restore(n, per_layer, compute, loads[name])
            modes = {"load": RestorePlan(n, 0, 0, 0), "half": RestorePlan(n, n // 2, 0, 0), "planned": plan}
            results = {mode: [] for mode in modes}
            for _ in range(args.rounds):
                for mode, mode_plan in modes.items():
                    with tier.read("conversation") as view:
                        _, layers = serialization.decode(view, worker.fingerprint, history)
                        results[mode].append(timed_turn(
                            worker, lambda p=mode_plan, layers=layers: restore_pipelined(worker, layers, history, p, cap),
                            new_tokens))
                        del layers
            ms = {mode: statistics.median(t for t, _ in rows) for mode, rows in results.items()}
            reports = [r for _, r in results["planned"]]
            restore_ms = statistics.median(r.total_ms for r in reports)
            bubble = statistics.median(r.bubble_fraction for r in reports)
            measured_c = statistics.median(r.compute_ms for r in reports)
            measured_l = statistics.median(r.load_ms for r in reports)
            better = min(recompute, ms["load"])
            table.row([n, name, f"{recompute:.0f}", f"{ms['load']:.0f}", f"{ms['half']:.0f}",
                       f"{ms['planned']:.0f} ({plan.recompute_tokens})", f"{ms['planned'] / better:.3f}×",
                       f"{plan.compute_ms:.1f} / {plan.load_ms:.1f}", f"{measured_c:.1f} / {measured_l:.1f}",
                       f"{plan.total_ms:.1f}", f"{restore_ms:.1f}", f"{bubble:.3f}"])


def _recomputed(worker, history):
    cache = worker.new_cache()
    worker.prefill(cache, history)
    return cache


if __name__ == "__main__":
    main()
