"""What restoring a compressed stored state costs next to recomputing a prefix (issue 6: why the restore
pipeline splits plain blobs only).

For SmolLM2-shaped states of about 1k, 2k and 4k tokens (random KV: the restore's work depends on the
layout, not on the values), each stored layout is restored by the service's own loader from a DRAM tier (BlobLoader: blob
checked and viewed, decoded, dense layers and per-head bias assembled into a cache) and timed, median
of 5: plain fp32, the int4 codec alone, per-head eviction at keep
0.5 alone, and both (the default's layout; eviction uses the `expected` scorer here, since which tokens
a head keeps does not change what the restore does). Next to it: the prefill of a short prefix on the
same model, the least a split's recompute side costs, and the time a 50 MB/s tier takes to deliver the
blob. A split can only pay off where delivering and decoding the blob takes longer than recomputing
a prefix does.

    python -m benchmarks.restore_decode --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.harness import StreamedTable, add_model_arguments, load_worker, machine_line
from scheduler.model_thread import ModelThread
from statekeeper.compression import by_name
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.kv_cache import KVCache
from statekeeper.profile import measure_compute
from statekeeper.sessions.restore import BlobLoader
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.dram import DramTier
from storage.manager import TierManager

LAYOUTS = ("none", "int4-rot-g32-s1", "expected@0.5", "expected@0.5+int4-rot-g32-s1")
SLOW_TIER_MB_PER_S = 50.0
SESSION = "restore-decode"


def stored_blob(worker: ModelWorker, layout: str, tokens: list[int]) -> bytearray:
    torch.manual_seed(0)
    shape = (worker.num_kv_heads, len(tokens), worker.head_dim)
    layers = [(torch.randn(shape, dtype=worker.dtype), torch.randn(shape, dtype=worker.dtype))
              for _ in range(worker.num_layers)]
    if layout == "none":
        return serialization.encode(layers, worker.fingerprint, tokens)
    stats = AttentionStats(worker.num_layers)
    query_heads = worker.model.config.num_attention_heads
    stats.recent_queries = [torch.randn(query_heads, 32, worker.head_dim).half() for _ in range(worker.num_layers)]
    compressed = by_name(layout).compress(layers, stats)
    return serialization.encode_tensors(compressed.tensors, worker.fingerprint, tokens, len(tokens), compressed.meta)


def restore(loader: BlobLoader, tokens: list[int]) -> KVCache:
    """The service's own restore of a blob it loads whole from DRAM (statekeeper/sessions/restore.py)."""
    loaded = loader.load(SESSION, tokens, plan=False)
    assert loaded is not None and loaded.tier == "dram", "the blob did not restore"
    return loaded.cache


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    worker = load_worker(args)
    compute = measure_compute(worker, (32, 64, 128))
    prefix = {length: compute.prefill_ms(length) for length in (32, 64)}
    print(f"machine: {machine_line()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"recompute of a prefix (the least a split's compute side costs): 32 tokens {prefix[32]:.0f} ms, "
          f"64 tokens {prefix[64]:.0f} ms\n")
    table = StreamedTable(["history", "stored layout", "blob MB", "restore ms (decode + assemble)",
                           f"delivered at {SLOW_TIER_MB_PER_S:.0f} MB/s + restore ms"])
    tiers, model_thread = TierManager([DramTier(1 << 40)]), ModelThread()
    loader = BlobLoader(worker, tiers, model_thread, None)
    for length in [int(x) for x in args.lengths.split(",")]:
        tokens = list(range(length))
        for layout in LAYOUTS:
            blob = stored_blob(worker, layout, tokens)
            tiers.put(SESSION, blob)
            restore(loader, tokens)  # untimed: first-touch of the buffers
            times = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                cache = restore(loader, tokens)
                times.append((time.perf_counter() - started) * 1e3)
                del cache
            ms, mb = statistics.median(times), len(blob) / 1e6
            table.row([length, layout, f"{mb:.1f}", f"{ms:.1f}", f"{mb / SLOW_TIER_MB_PER_S * 1e3 + ms:.0f}"])
    model_thread.shutdown()


if __name__ == "__main__":
    main()
