"""The placement cost profile of this machine and model (issue 32): what a return costs in each form and
place, and what compressing costs, measured here and written as the JSON file the simulator, the planner and
the expected-value policy read (statekeeper/placement/costs.py).

    python -m benchmarks.cost_profile --out statekeeper/simulation/profiles/smollm2-135m-xeon-1thread.json

- recompute and tier reads: the service's own restore profile (statekeeper/profile.py `measure`, the lengths
  `statekeeper profile` uses) over the default tiers (DRAM, LMDB, SSD files) in a temporary directory;
- compressing: the default compression of an exact blob as the compression process runs it
  (sessions/compress_process.py `compress_exact_blob`: KVzip scoring, eviction, the codec), CPU seconds of
  this process at --threads, on ShareGPT conversations cut to each length; fitted as linear + quadratic ms;
- decoding a compressed blob: the service's loader (sessions/restore.py BlobLoader) restoring it whole from
  DRAM, less the DRAM read of its bytes, per token."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line
from scheduler.model_thread import ModelThread
from scheduler.plan import ComputeProfile
from statekeeper.config import CompressionConfig
from statekeeper.settings import Settings
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.placement.costs import CostProfile
from statekeeper.profile import FULL_LENGTHS, FULL_PROBE_TOKENS, measure
from statekeeper.sessions.compress_process import compress_exact_blob
from statekeeper.sessions.restore import BlobLoader
from storage import serialization
from storage.dram import DramTier
from storage.factory import build_tier_manager
from storage.manager import TierManager

KEY = "cost-profile"


def sharegpt_tokens(worker, length: int) -> list[int]:
    """Real text: ShareGPT conversations' messages one after another, cut to `length` tokens."""
    tokens = []
    for conversation in sharegpt_conversations(min_turns=2):
        for _, content in conversation:
            tokens += worker.tokenizer.encode(content)
        if len(tokens) >= length:
            return tokens[:length]
    raise ValueError(f"ShareGPT holds fewer than {length} tokens")


def exact_blob(worker, tokens: list[int]) -> bytearray:
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    return serialization.encode(cache.export_layers(), worker.fingerprint, tokens)


def compression_costs(worker, lengths: list[int], repeats: int) -> tuple[list, list]:
    """(tokens, compress CPU ms) and (tokens, compressed bytes, loader restore ms) per length."""
    config = CompressionConfig()
    compress, restore = [], []
    tiers, model_thread = TierManager([DramTier(1 << 40)]), ModelThread()
    loader = BlobLoader(worker, tiers, model_thread, None)
    try:
        for length in lengths:
            tokens = sharegpt_tokens(worker, length)
            blob = exact_blob(worker, tokens)
            cpu = []
            for _ in range(repeats):
                started = time.process_time()
                compressed = compress_exact_blob(worker, blob, tokens, config)
                cpu.append((time.process_time() - started) * 1e3)
            compress.append((length, statistics.median(cpu)))
            tiers.put(KEY, compressed)
            loader.load(KEY, tokens, plan=False)  # untimed: first touch of the buffers
            times = []
            for _ in range(repeats + 2):
                started = time.perf_counter()
                loaded = loader.load(KEY, tokens, plan=False)
                times.append((time.perf_counter() - started) * 1e3)
                assert loaded is not None and loaded.tier == "dram", "the compressed blob did not restore"
                del loaded
            restore.append((length, len(compressed), len(blob), statistics.median(times)))
            print(f"{length} tokens: compress {compress[-1][1]:.0f} CPU ms, exact {len(blob)} B, "
                  f"compressed {len(compressed)} B, compressed restore {restore[-1][3]:.1f} ms", flush=True)
    finally:
        model_thread.shutdown()
    return compress, restore


def fit_through_origin(points: list[tuple[int, float]]) -> tuple[float, float]:
    """ms = a * n + b * n^2, least squares."""
    s11 = sum(n * n for n, _ in points)
    s12 = sum(n ** 3 for n, _ in points)
    s22 = sum(n ** 4 for n, _ in points)
    r1 = sum(n * ms for n, ms in points)
    r2 = sum(n * n * ms for n, ms in points)
    det = s11 * s22 - s12 * s12
    a, b = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if b < 0:  # not convex over these points: a line
        return r1 / s11, 0.0
    return max(0.0, a), b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--compress-lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    line = machine_line()
    print(line, flush=True)
    worker = load_worker(args)
    with tempfile.TemporaryDirectory() as directory:
        config = Settings(data_dir=Path(directory), ssd_enabled=True).to_config()  # DRAM, LMDB, SSD files, in a temporary directory
        tiers = build_tier_manager(config.tiers, None, False)
        try:
            hardware = measure(worker, tiers.tiers, FULL_LENGTHS, FULL_PROBE_TOKENS)
        finally:
            tiers.close()
    compute: ComputeProfile = hardware.compute
    print(f"recompute: {compute.prefill_ms(1024):.0f} ms at 1,024 tokens; tiers: "
          + ", ".join(f"{name} {load.read_ms(1 << 20):.2f} ms/MiB" for name, load in hardware.tiers.items()), flush=True)
    compress, restore = compression_costs(worker, [int(x) for x in args.compress_lengths.split(",")], args.repeats)
    linear, quadratic = fit_through_origin(compress)
    dram = hardware.tiers["dram"]
    decode = statistics.median((ms - dram.read_ms(size)) / tokens for tokens, size, _, ms in restore)
    ratio = statistics.median(exact / size for _, size, exact, _ in restore)
    profile = CostProfile(
        worker.kv_bytes_per_token, compute, hardware.tiers, round(ratio, 2), round(max(0.0, decode), 5), round(linear, 4),
        quadratic, 1, name=f"{args.model} on this machine, {args.threads} thread(s)",
        notes=[f"measured by `python -m benchmarks.cost_profile` on {line}",
               f"bytes_per_token: the exact KV in {worker.kv_dtype} ({worker.num_layers} layers x "
               f"{worker.num_kv_heads} KV heads x {worker.head_dim} x 2)",
               "compute and tiers: statekeeper/profile.py measure() over the default DRAM, LMDB and SSD tiers",
               f"compress: the default compression's CPU ms, fitted to {compress}",
               f"compressed_decode_ms_per_token and compression_ratio: the loader restoring compressed blobs "
               f"from DRAM, (tokens, bytes, exact bytes, ms) = {restore}",
               "compress_workers: 1 (the service's one compression process)"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
