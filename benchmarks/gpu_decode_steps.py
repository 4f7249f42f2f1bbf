"""Decode steps on a GPU as the KV grows a token a step (issue 34): host milliseconds a step for the worker's
own decode and packed steps and prefill chunks, and for a single SDPA call of a decode step's shape, with PyTorch's default
choice of SDPA backend beside the worker's, without cuDNN's. cuDNN's attention builds an execution graph per
shape, and a decode step's KV length is a new shape every step: under several ShareGPT users on an H100 the
service's model thread spent 84% of its time inside the SDPA call with the GPU idle (BENCHMARKS.md).

    python -m benchmarks.gpu_decode_steps --json OUT

Random weights in SmolLM2's shape (benchmarks/profiles/gpu-shapes.json): time depends on shapes, not values.
The CUDA kernels each setting ran are listed by name (from torch's profiler), so the table says which
backend the default picked."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_restore import random_worker
from benchmarks.harness.results import machine_record, write_json
from benchmarks.harness.tables import markdown_table
from statekeeper.batch_forward import Segment

WITHOUT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Every backend enabled, in PyTorch's own order of preference: its default (the worker turns cuDNN's off).
SETTINGS = {"every backend (PyTorch's default)": [SDPBackend.CUDNN_ATTENTION, *WITHOUT_CUDNN],
            "without cuDNN (the worker's)": WITHOUT_CUDNN}


def _host_ms_per_call(run, calls: int) -> float:
    """Host time a call, each call waited for as the service waits for a step's logits."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for index in range(calls):
        run(index)
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3 / calls


def _attention_kernels(run) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(0)
        torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    return sorted(name[:60] for name in names if any(part in name.lower() for part in ("cudnn", "flash", "fmha", "attention", "sdpa")))


def sdpa_case(context: int, steps: int) -> dict:
    """One decode step's SDPA in SmolLM2's GQA shape (9 query heads, 3 KV heads, dim 64), KV one longer a call."""
    query = torch.randn(1, 9, 1, 64, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(1, 3, context + steps + 1, 64, device="cuda", dtype=torch.bfloat16)

    def run(index: int):
        length = context + index
        torch.nn.functional.scaled_dot_product_attention(query, keys[:, :, :length], keys[:, :, :length],
                                                         enable_gqa=True)
    return {"ms": _host_ms_per_call(run, steps), "kernels": _attention_kernels(run)}


def worker_case(worker, context: int, steps: int, sessions: int) -> dict:
    """The worker's decode steps: one conversation alone, or `sessions` packed into each step."""
    caches = []
    prompt = list(range(100, 100 + context))
    for _ in range(sessions):
        cache = worker.new_cache()
        worker.prefill(cache, prompt)
        caches.append(cache)

    def run(index: int):
        logits = worker.step([Segment(cache, [42 + index]) for cache in caches])
        [int(row.argmax()) for row in logits]
    run(0)  # the first step after a prefill
    return {"ms": _host_ms_per_call(run, steps), "kernels": _attention_kernels(run)}


def prefill_case(worker, context: int, chunks: int) -> dict:
    """Prefill chunks (the worker's chunk size) onto a history of `context` tokens: the KV grows a chunk a call,
    so each is a new shape too; cuDNN's attention may be the faster kernel for long queries on an H100."""
    chunk = worker.config.prefill_chunk_tokens
    cache = worker.new_cache()
    worker.prefill(cache, list(range(100, 100 + context)))

    def run(index: int):
        int(worker.prefill(cache, list(range(200, 200 + chunk))).argmax())
    return {"ms": _host_ms_per_call(run, chunks), "kernels": _attention_kernels(run)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    worker = random_worker("smollm2-135m", "cuda", 512)
    results = {}
    for name, backends in SETTINGS.items():
        with sdpa_kernel(backends):
            results[name] = {"sdpa call": sdpa_case(args.context, args.steps),
                             "decode step, 1 conversation": worker_case(worker, args.context, args.steps, 1),
                             "decode step, 3 packed": worker_case(worker, args.context, args.steps, 3),
                             "prefill chunk of 512 tokens": prefill_case(worker, args.context, 8)}
    record = machine_record()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; "
          f"{record['line']}; KV from {args.context} tokens, {args.steps} steps")
    cases = list(next(iter(results.values())))
    print(markdown_table(["host ms a call", *results],
                         [[case, *(f"{results[name][case]['ms']:.2f}" for name in results)] for case in cases]))
    for name, by_case in results.items():
        print(f"{name}: kernels {sorted({k for case in by_case.values() for k in case['kernels']})}")
    if args.json:
        write_json(args.json, {"context": args.context, "steps": args.steps, "results": results}, machine=record)


if __name__ == "__main__":
    main()
