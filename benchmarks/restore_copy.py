"""Restore of one stored state (decode + copy into the cache) with and without the allocator tuning of
statekeeper/memory.py, each in its own process (mallopt is process-wide). SmolLM2's shape, 1,500 tokens.

    python -m benchmarks.restore_copy
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from benchmarks.harness import markdown_table
from benchmarks.harness.machine import REPO


def measure(tuned: bool, rounds: int = 15) -> list[float]:
    import torch

    from statekeeper.kv_cache import KVCache
    from statekeeper.memory import keep_freed_memory_warm
    from storage import serialization

    if tuned:
        keep_freed_memory_warm()
    torch.set_num_threads(1)
    layers = [(torch.randn(3, 1500, 64), torch.randn(3, 1500, 64)) for _ in range(30)]
    tokens = list(range(1501))
    times = []
    for _ in range(rounds):
        blob = serialization.encode(layers, "m", tokens)
        started = time.perf_counter()
        _, views = serialization.decode(blob, "m", tokens)
        cache = KVCache.from_layers(views, torch.device("cpu"))
        times.append((time.perf_counter() - started) * 1000)
        del cache, views, blob
    return times[1:]  # the first round pays one-off initialisation in both modes


def main() -> None:
    if len(sys.argv) > 1:
        print(statistics.median(measure(sys.argv[1] == "tuned")))
        return
    results = {}
    for mode in ("default", "tuned"):
        out = subprocess.run([sys.executable, "-m", "benchmarks.restore_copy", mode], cwd=REPO, capture_output=True,
                             text=True, check=True)
        results[mode] = float(out.stdout.strip().splitlines()[-1])
    print(markdown_table(["allocator", "restore of 1,500 tokens (69 MB), median ms"],
                         [["glibc defaults", f"{results['default']:.1f}"],
                          ["keep_freed_memory_warm()", f"{results['tuned']:.1f}"]]))


if __name__ == "__main__":
    main()
