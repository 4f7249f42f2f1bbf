"""Does a restore wait behind another session's offload? (issue 14, lock hygiene)

A TierManager over DRAM and LMDB, SmolLM2-shaped fp32 states (30 layers, 3 KV heads, head dim 64; random
values: the cost is in the bytes, not in what they say). A 1k-token state sits in LMDB; its restore (the
manager's read, the blob checked and decoded, the layers copied out) is timed --restores times with
nothing else running, then as many times while another thread offloads 4k-token states over and over
into DRAM, each one pushing the previous one down into LMDB (a 184 MB write and its fsync). Reported:
restore p50 / p95 / max in both phases and their ratio. Restores are --gap-ms apart, so that they meet
the offloads at every stage (transcoding, demotion, the LMDB write and its fsync).

    python -m benchmarks.lock_hygiene --restores 40
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from benchmarks.harness import machine_line, markdown_table, percentile

from storage import serialization
from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
FINGERPRINT = "lock-hygiene"


def state(tokens: int, seed: int) -> tuple[bytearray, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (KV_HEADS, tokens, HEAD_DIM)
    layers = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)) for _ in range(LAYERS)]
    ids = list(range(tokens))
    return serialization.encode(layers, FINGERPRINT, ids), ids


def restore_ms(manager: TierManager, key: str, tokens: list[int]) -> float:
    started = time.perf_counter()
    with manager.read(key) as (_, blob):
        _, layers = serialization.decode(blob, FINGERPRINT, tokens)
        copies = [(k.clone(), v.clone()) for k, v in layers]
    assert len(copies) == LAYERS
    return (time.perf_counter() - started) * 1e3


def measure(manager: TierManager, tokens: list[int], count: int, gap_s: float = 0.0) -> list[float]:
    times = []
    for _ in range(count):
        times.append(restore_ms(manager, "restored", tokens))
        time.sleep(gap_s)  # users arrive apart: the restores spread over many offloads
    return times


def summary(times: list[float]) -> dict:
    return {"p50": statistics.median(times), "p95": percentile(times, 0.95), "max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restores", type=int, default=40)
    parser.add_argument("--restore-tokens", type=int, default=1024)
    parser.add_argument("--offload-tokens", type=int, default=4096)
    parser.add_argument("--gap-ms", type=float, default=200, help="pause between two restores")
    args = parser.parse_args()
    torch.set_num_threads(1)
    restored, restored_ids = state(args.restore_tokens, 0)
    offloaded, _ = state(args.offload_tokens, 1)
    with tempfile.TemporaryDirectory(prefix="lock-hygiene-") as root:
        # DRAM holds one offloaded state: each new one demotes the previous into LMDB.
        manager = TierManager([DramTier(int(len(offloaded) * 1.5)), LmdbTier(Path(root) / "kv.lmdb", 4 << 30)])
        manager.put("restored", restored, tier="lmdb")
        measure(manager, restored_ids, 3)  # warm: page cache, allocator
        alone = measure(manager, restored_ids, args.restores, args.gap_ms / 1e3)
        stop, offloads = threading.Event(), [0]

        def offload_forever():
            while not stop.is_set():
                manager.put(f"offloaded-{offloads[0] % 3}", offloaded)
                offloads[0] += 1

        writer = threading.Thread(target=offload_forever)
        writer.start()
        time.sleep(0.5)
        try:
            beside = measure(manager, restored_ids, args.restores, args.gap_ms / 1e3)
        finally:
            stop.set()
            writer.join()
    a, b = summary(alone), summary(beside)
    print(f"machine: {machine_line()}; restore of {args.restore_tokens} tokens "
          f"({len(restored) / 2**20:.1f} MB) from LMDB, offloads of {args.offload_tokens} tokens "
          f"({len(offloaded) / 2**20:.1f} MB), {offloads[0]} offloads during the second phase\n")
    columns = ("p50", "p95", "max")
    print(markdown_table(["restore ms", *columns], [
        ["alone", *(f"{a[c]:.1f}" for c in columns)],
        ["beside a 4k-token offload loop", *(f"{b[c]:.1f}" for c in columns)],
        ["ratio", *(f"{b[c] / a[c]:.2f}×" for c in columns)]]))


if __name__ == "__main__":
    main()
