"""What a forward with a new row count leaves in memory (issue 28): the heap bytes in use that stay after
prefills of row counts the process has not run before, and what a first forward at a row count costs against
a repeat, with the kernel libraries' caches as they ship and capped.

    python -m benchmarks.kernel_cache_memory --configs default,onednn-0,capped-64 --json kernel-cache.json

Each configuration runs in a fresh process (the caches are per process and read their capacity from the
environment at first use): the live model is loaded, a 200-token history prefilled, then for each row count
of --rows (START:STOP:STEP) a prefill of that many tokens onto a copy of the history, twice (the first run of a
row count, then a repeat). The heap's in-use bytes (glibc's mallinfo2, statekeeper.memory.heap_bytes, after a
garbage collection) are read before and after the sweep; no tensor outlives a prefill, so what stays is held
below Python. Configurations: default (the libraries' own capacities), onednn-0
(ONEDNN_PRIMITIVE_CACHE_CAPACITY=0: oneDNN's primitive cache off), capped-64 (oneDNN's primitive cache and
ideep's LRU_CACHE_CAPACITY at 64 entries each)."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from benchmarks.harness import machine_line, markdown_table, write_json
from benchmarks.harness.child import child_result
from benchmarks.harness.model import add_model_arguments, load_worker
from statekeeper.memory import heap_bytes

CONFIGS = {
    "default": {},
    "onednn-0": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"},
    "capped-64": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "64"},
}
HISTORY_TOKENS = 200


def in_use_mib() -> float:
    gc.collect()
    return heap_bytes()["in_use"] / 2**20


def sweep(args: argparse.Namespace) -> dict:
    """In this process: the heap growth and forward times over the row counts."""
    worker = load_worker(args)
    ids = worker.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 800)
    start, stop, step = (int(part) for part in args.rows.split(":"))
    rows = list(range(start, stop, step))
    if HISTORY_TOKENS + max(rows) > len(ids):
        raise SystemExit(f"--rows up to {max(rows)} needs a longer text")

    def prefill_ms(count: int) -> float:
        cache = worker.new_cache()
        worker.prefill(cache, ids[:HISTORY_TOKENS])
        started = time.perf_counter()
        worker.prefill(cache, ids[HISTORY_TOKENS : HISTORY_TOKENS + count])
        return (time.perf_counter() - started) * 1000

    for count in (7, 13):  # the decode-sized kernels and the history's own shapes, before the reading
        prefill_ms(count)
    before = in_use_mib()
    first, repeat = [], []
    for count in rows:
        first.append(prefill_ms(count))
        repeat.append(prefill_ms(count))
    grown = in_use_mib() - before
    return {"row_counts": len(rows), "heap_in_use_before_mib": before, "heap_grown_mib": grown,
            "kib_per_row_count": grown * 1024 / len(rows), "first_ms_median": statistics.median(first),
            "repeat_ms_median": statistics.median(repeat),
            "first_minus_repeat_ms_median": statistics.median(f - r for f, r in zip(first, repeat))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--configs", default="default,onednn-0,capped-64", help=f"of {', '.join(CONFIGS)}")
    parser.add_argument("--rows", default="20:260:3", help="row counts START:STOP:STEP (prefill chunk sizes)")
    parser.add_argument("--json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if heap_bytes() is None:
        raise SystemExit("needs glibc's mallinfo2 (Linux, glibc >= 2.33)")
    if args.child:
        print(json.dumps(sweep(args)))
        return
    print(machine_line(), flush=True)
    results = {}
    for name in args.configs.split(","):
        results[name] = child_result("benchmarks.kernel_cache_memory",
                                     ["--child", "--rows", args.rows, "--model", args.model, "--model-cache",
                                      str(args.model_cache), "--threads", str(args.threads)], CONFIGS[name])
        print(f"{name}: {results[name]}", flush=True)
    table = [[name, " ".join(f"{k}={v}" for k, v in CONFIGS[name].items()) or "—", r["row_counts"],
              f"{r['heap_grown_mib']:.1f}", f"{r['kib_per_row_count']:.0f}", f"{r['first_ms_median']:.1f}",
              f"{r['repeat_ms_median']:.1f}", f"{r['first_minus_repeat_ms_median']:.1f}"]
             for name, r in results.items()]
    print(markdown_table(["config", "environment", "new row counts", "heap in use grown MiB", "KiB a row count",
                          "first prefill ms (median)", "repeat ms (median)", "first − repeat ms (median)"], table))
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
