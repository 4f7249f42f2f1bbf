"""Where a decode step's time goes (issue 31): torch's profiler over single-stream decode steps of the live
model at a given context, per KV dtype, grouped into the model's parts.

    python -m benchmarks.decode_profile --context 1000 --kv-dtypes bfloat16,float32 --json decode-profile.json

Each KV dtype runs in a fresh process (a second profile in one process ran ~25% slower than the first,
whichever dtype came first): a --context-token history is prefilled, a few steps warm up, --steps steps are timed (the
wall time a step, no profiler), then --steps more run under torch.profiler. Each operator's self CPU time a
step is reported, and grouped: the decoder's 4-bit linears (aten::_weight_int4pack_mm_for_cpu), the int8
output layer (aten::_weight_int8pack_mm), attention (aten::_scaled_dot_product_flash_attention_for_cpu), dtype
conversions and copies (aten::copy_, _to_copy, to, empty_strided), and the rest (norms, rotary, elementwise);
the step's wall time less the operators' total is what runs outside torch's operators (Python, module calls,
the profiler's own cost included)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from benchmarks.harness.child import child_result

GROUPS = {
    "int4 linears": ("aten::_weight_int4pack_mm_for_cpu",),
    "int8 output layer": ("aten::_weight_int8pack_mm",),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "conversions and copies": ("aten::copy_", "aten::_to_copy", "aten::to", "aten::empty_strided"),
}


def profile_dtype(worker, dtype: str, context: int, steps: int) -> dict:
    worker.use_kv_dtype(getattr(torch, dtype))
    tokens = worker.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * (context // 8 + 1))[:context]
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    for _ in range(3):
        worker.decode(cache, 42)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        worker.decode(cache, 42)
        times.append((time.perf_counter() - started) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            worker.decode(cache, 42)
    per_op = {event.key: event.self_cpu_time_total / 1e3 / steps for event in prof.key_averages()}
    grouped = {name: sum(per_op.get(op, 0.0) for op in ops) for name, ops in GROUPS.items()}
    grouped["other operators"] = sum(per_op.values()) - sum(grouped.values())
    return {"step_ms": statistics.median(times), "operators_ms": sum(per_op.values()), "groups_ms": grouped,
            "top_ops_ms": dict(sorted(per_op.items(), key=lambda item: -item[1])[:15])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kv-dtypes", default="bfloat16,float32")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(profile_dtype(load_worker(args), args.child, args.context, args.steps)))
        return
    print(machine_line(), flush=True)
    results = {}
    for dtype in args.kv_dtypes.split(","):
        results[dtype] = child_result("benchmarks.decode_profile",
                                      ["--child", dtype, "--context", str(args.context), "--steps", str(args.steps),
                                       "--model", args.model, "--model-cache", str(args.model_cache),
                                       "--threads", str(args.threads)])
    names = [*GROUPS, "other operators"]
    rows = [[dtype, f"{r['step_ms']:.1f}", *(f"{r['groups_ms'][name]:.1f}" for name in names),
             f"{r['step_ms'] - r['operators_ms']:.1f}"] for dtype, r in results.items()]
    print(markdown_table(["KV dtype", "step ms (no profiler)", *(f"{name} ms" for name in names),
                          "outside operators ms"], rows))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
