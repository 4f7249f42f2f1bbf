"""Weight precision (issue 17, "faster weights"): what each way of holding the live model's linear weights
(kernels/weight_linear.py, the WEIGHT_PRECISION setting) does to speed and to the replies.

speed: one model per format loaded side by side in one process; a real ShareGPT history cut to
--context tokens; per round, each format's prefill of it (the worker's own chunked prefill, ms), then
--steps greedy decode steps after it, the formats taking turns at every step in a rotating order (so
a change in the machine's load falls on all of them); the caches are cut back to the context after
each round. Medians over rounds (prefill) and over every step (decode), per torch thread count.

fidelity: the fidelity harness's ShareGPT continuations (statekeeper/evaluation/teacher_forcing.py:
the real next user turn and assistant reply, teacher-forced after a ~--context-token history) scored
with each format against fp32 weights: top-1 agreement, KL(fp32 || format) per token, the perplexity
ratio on the assistant tokens, and each one's next-token accuracy on the real reply.

profile: torch.profiler over --steps decode steps at --context tokens for each format: self time of
the linear kernels, attention, the other ops, and the rest of the step's wall time (Python and
dispatch around the ops).

    python -m benchmarks.weight_precision speed --threads 1,2
    python -m benchmarks.weight_precision fidelity --conversations 40
    python -m benchmarks.weight_precision fidelity --formats fp32+kv-bfloat16,int4-g32-int8head,int4-g32-int8head+kv-bfloat16

A format may name a KV cache dtype after "+kv-" (the KV_DTYPE setting): the weights as named, the live KV
cache kept in that dtype; without it the cache is float32 (bf16: bfloat16, the model's), and the reference is
fp32 weights with a float32 cache. A quantized format may name its many-row GEMM after "+gemm-" (bfloat16 or
float32, what statekeeper/dense_rows_choice.py picks at start, or none: the kernel at every row count; without
it, kernels/weight_linear.py's default, from 16 rows):
    python -m benchmarks.weight_precision speed --formats int4-g32-int8head+gemm-bfloat16,int4-g32-int8head+gemm-float32
    python -m benchmarks.weight_precision profile --formats fp32,dyn-int8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, write_json
from benchmarks.harness.machine import commit

from kernels.weight_linear import use_dense_from_rows, use_gemm
from statekeeper.chat import ChatFormatter
from statekeeper.config import WorkerConfig
from statekeeper.dense_rows_choice import NEVER
from statekeeper.evaluation import datasets
from statekeeper.evaluation.teacher_forcing import (FidelityTotals, build_state, compare_rows, log_probs,
                                                    sharegpt_cases)
from statekeeper.kv_cache import KVCache
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker

BF16 = "bf16"  # a reference row: the whole model in bfloat16 (STATEKEEPER_DTYPE=bfloat16), fp32 "weights"
KV_SUFFIX = "+kv-"  # a format with a KV cache dtype (WorkerConfig.kv_dtype): fp32+kv-bfloat16
GEMM_SUFFIX = "+gemm-"  # a quantized format's many-row GEMM (kernels/weight_linear.py GEMMS, or none): int4-g32+gemm-float32
FORMATS = "fp32,bf16,dyn-int8,int8,int4-g32,int4-g64"


def load_workers(names: list[str], args) -> dict[str, ModelWorker]:
    workers = {}
    for name in names:
        dtype, weights = ("bfloat16", "fp32") if name == BF16 else ("auto", name)
        weights, _, gemm = weights.partition(GEMM_SUFFIX)  # ...+gemm-float32: that GEMM for many rows
        weights, _, kv = weights.partition(KV_SUFFIX)  # int4-g32-int8head+kv-bfloat16: that KV cache dtype
        config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), dtype=dtype, weight_precision=weights,
                              kv_dtype=kv or ("float32" if dtype == "auto" else "auto"))
        workers[name] = ModelWorker(load_model(config.model, config.model_cache_dir, dtype=dtype), config)
        if gemm == "none":  # the quantized kernel at every row count
            use_dense_from_rows(workers[name].model.modules(), NEVER)
        elif gemm:
            use_gemm(workers[name].model.modules(), gemm)
    return workers


def context(worker: ModelWorker, num_tokens: int) -> list[int]:
    """A real conversation's tokens, cut to `num_tokens`."""
    formatter = ChatFormatter(worker.tokenizer)
    case, = sharegpt_cases(formatter, datasets.sharegpt_conversations(min_turns=4), num_tokens, 1,
                           worker.tokenizer.eos_token_id)
    tokens = case.history + case.continuation
    if len(tokens) < num_tokens:
        raise SystemExit(f"the conversation found has {len(tokens)} tokens, fewer than {num_tokens}")
    return tokens[:num_tokens]


def rotated(names: list[str], by: int) -> list[str]:
    by %= len(names)
    return names[by:] + names[:by]


def measure_speed(workers: dict[str, ModelWorker], tokens: list[int], steps: int, rounds: int) -> dict:
    names = list(workers)
    prefill_ms, decode_ms = defaultdict(list), defaultdict(list)
    caches, next_token = {}, {}
    for name, worker in workers.items():  # untimed: first touch of every path
        caches[name] = worker.new_cache()
        next_token[name] = int(worker.prefill(caches[name], tokens).argmax())
        worker.decode(caches[name], next_token[name])
        caches[name].truncate(len(tokens))
    for round_index in range(rounds):
        for name in rotated(names, round_index):
            cache = workers[name].new_cache()
            started = time.perf_counter()
            workers[name].prefill(cache, tokens)
            prefill_ms[name].append((time.perf_counter() - started) * 1e3)
        token = dict(next_token)
        for step in range(steps):
            for name in rotated(names, round_index + step):
                started = time.perf_counter()
                token[name] = int(workers[name].decode(caches[name], token[name]).argmax())
                decode_ms[name].append((time.perf_counter() - started) * 1e3)
        for cache in caches.values():
            cache.truncate(len(tokens))
    return {name: {"prefill_ms": statistics.median(prefill_ms[name]),
                   "decode_ms": statistics.median(decode_ms[name]),
                   "weight_mb": weight_bytes(workers[name].model) / 1e6} for name in names}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the linear layers (the embedding, read one row a token, left out)."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes
        elif hasattr(module, "weight_bytes"):
            total += module.weight_bytes
    return total


def speed(args) -> None:
    names = args.formats.split(",")
    workers = load_workers(names, args)
    tokens = context(workers[names[0]], args.context)
    results = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        results[threads] = measure_speed(workers, tokens, args.steps, args.rounds)
        print(json.dumps({"threads": threads, **results[threads]}), flush=True)
    print(describe(args))
    print(f"\ncontext {len(tokens)} tokens; prefill of all of it, decode after it ({args.steps} steps x {args.rounds} "
          "rounds, medians)\n")
    table = []
    for threads, rows in results.items():
        base = rows.get("fp32")
        for name, row in rows.items():
            ratio = (lambda key: f"{row[key] / base[key]:.2f}") if base else (lambda key: "-")
            table.append([name, threads, f"{row['weight_mb']:.0f}", f"{row['decode_ms']:.1f}",
                          f"{1e3 / row['decode_ms']:.1f}", ratio("decode_ms"), f"{row['prefill_ms']:.0f}",
                          ratio("prefill_ms")])
    print(markdown_table(["weights", "threads", "linear weights MB", "decode ms/token", "tokens/s", "× fp32 decode",
                          "prefill ms", "× fp32 prefill"], table))
    if args.json:
        write_json(args.json, {"context": len(tokens), "results": results})


def fidelity(args) -> None:
    names = args.formats.split(",")
    if names[0] != "fp32":
        names.insert(0, "fp32")
    workers = load_workers(names, args)
    torch.set_num_threads(int(args.threads.split(",")[0]))
    reference = workers["fp32"]
    formatter = ChatFormatter(reference.tokenizer)
    cases = sharegpt_cases(formatter, datasets.sharegpt_conversations(min_turns=4), args.context, args.conversations,
                           reference.tokenizer.eos_token_id)
    totals = defaultdict(FidelityTotals)
    for index, case in enumerate(cases):
        fed = case.history[-1:] + case.continuation  # as compare_continuation feeds it
        rows = {}
        for name, worker in workers.items():
            state = build_state(worker, case.history[:-1])
            rows[name] = log_probs(worker, state.cache, fed)
        for name in names[1:]:
            totals[name].add(compare_rows(rows["fp32"], rows[name], case.continuation, case.spans))
        print(f"case {index + 1}/{len(cases)}: {len(case.history)} history tokens, {totals[names[1]].tokens} scored; "
              + ", ".join(f"{n} {totals[n].top1_agreement:.3f}/{totals[n].mean_kl:.3f}" for n in names[1:]),
              file=sys.stderr, flush=True)
    print(describe(args))
    print(f"\n{len(cases)} ShareGPT continuations after ~{args.context}-token histories, "
          f"{totals[names[1]].tokens} scored assistant tokens\n")
    table = []
    for name in names[1:]:
        t = totals[name]
        table.append([name, f"{t.top1_agreement:.4f}", f"{t.mean_kl:.4f}", f"{t.perplexity_ratio:.4f}",
                      f"{t.full_hits / t.tokens:.4f} : {t.compressed_hits / t.tokens:.4f}"])
    print(markdown_table(["weights", "top-1 agreement with fp32", "KL(fp32 ‖ it) per token", "perplexity ratio",
                          "next-token accuracy (fp32: it)"], table))
    if args.json:
        write_json(args.json, {name: {"tokens": t.tokens, "top1_agreement": t.top1_agreement, "mean_kl": t.mean_kl,
                                      "perplexity_ratio": t.perplexity_ratio} for name, t in totals.items()})


LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu",
              "quantized::linear_dynamic")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                 "aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::_softmax")


def profile(args) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    names = args.formats.split(",")
    workers = load_workers(names, args)
    tokens = context(workers[names[0]], args.context)
    torch.set_num_threads(int(args.threads.split(",")[0]))
    print(describe(args))
    print(f"\none decode step at {len(tokens)} tokens, mean of {args.steps} steps under torch.profiler (ms)\n")
    print("| weights | step wall | linear kernels | attention | other ops | outside the ops (Python, dispatch) | top other ops |")
    print("|---|---|---|---|---|---|---|")
    for name, worker in workers.items():
        cache = worker.new_cache()
        token = int(worker.prefill(cache, tokens).argmax())
        for _ in range(3):
            token = int(worker.decode(cache, token).argmax())
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            for _ in range(args.steps):
                token = int(worker.decode(cache, token).argmax())
            wall_ms = (time.perf_counter() - started) * 1e3 / args.steps
        by_op = {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in prof.key_averages()}
        linear = sum(ms for op, ms in by_op.items() if op in LINEAR_OPS)
        attention = sum(ms for op, ms in by_op.items() if op in ATTENTION_OPS)
        other = {op: ms for op, ms in by_op.items() if op not in LINEAR_OPS and op not in ATTENTION_OPS}
        top = sorted(other.items(), key=lambda item: -item[1])[:4]
        print(f"| {name} | {wall_ms:.1f} | {linear:.1f} | {attention:.1f} | {sum(other.values()):.1f} "
              f"| {wall_ms - linear - attention - sum(other.values()):.1f} | "
              + ", ".join(f"{op.removeprefix('aten::')} {ms:.1f}" for op, ms in top) + " |", flush=True)


def describe(args) -> str:
    return (f"\nmachine: {machine_line()}, torch {torch.__version__}, "
            f"quantized engine {torch.backends.quantized.engine}; commit {commit()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("speed", "fidelity", "profile"))
    parser.add_argument("--model", default="smollm2", help="smollm2 or a local Hugging Face model directory")
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    parser.add_argument("--formats", default=FORMATS, help=f"comma-separated WEIGHT_PRECISION names, or {BF16}")
    parser.add_argument("--threads", default="1", help="torch threads, comma-separated (speed: one row each)")
    parser.add_argument("--context", type=int, default=1000, help="tokens of history")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round (profile: profiled steps)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=40, help="fidelity: ShareGPT continuations")
    parser.add_argument("--json", help="write the measured rows here")
    args = parser.parse_args()
    {"speed": speed, "fidelity": fidelity, "profile": profile}[args.what](args)


if __name__ == "__main__":
    main()
