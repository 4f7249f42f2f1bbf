"""Per-tier put/get throughput and latency for 1, 8 and 64 MB blobs, plus the tier manager's own
bookkeeping cost per turn. One run, all tiers side by side.

    python -m benchmarks.tier_throughput

"get" copies the blob out (bytes); "read" is the restore path: the zero-copy view a restore uses, plus
an xxh3 pass over it (what the blob checksum costs anyway), which forces every page to be read. LMDB
and SSD reads are from the page cache (just written) unless marked cold: SSD cold evicts the file's
pages with posix_fadvise(DONTNEED) first. Redis runs on loopback (a local redis-server is started)."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import xxhash

from benchmarks.harness import StreamedTable, machine_line

from storage.tier import Tier
from storage.dram import DramTier
from storage.index import LmdbTierIndex, MemoryTierIndex
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager
from storage.redis_tier import RedisTier
from storage.ssd import SsdTier
from benchmarks.harness.redis_server import RedisServer

MB = 1 << 20
SIZES = {1: 20, 8: 10, 64: 5}  # blob MB -> repetitions


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def evict_from_page_cache(tier: SsdTier, key: str) -> None:
    with open(tier._path(key), "rb") as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_all(tier: Tier, key: str) -> None:
    with tier.read(key) as view:
        xxhash.xxh3_64_intdigest(view)


def measure(tier: Tier, size_mb: int, reps: int, cold: bool = False) -> dict:
    blob = os.urandom(size_mb * MB)
    keys = [f"bench-{size_mb}-{i}" for i in range(reps)]
    put_ms = [timed(lambda k=k: tier.put(k, blob)) for k in keys]
    if cold:
        for key in keys:
            evict_from_page_cache(tier, key)
    read_ms = [timed(lambda k=k: read_all(tier, k)) for k in keys]
    if cold:
        for key in keys:
            evict_from_page_cache(tier, key)
    get_ms = [timed(lambda k=k: tier.get(k)) for k in keys]
    for key in keys:
        tier.delete(key)
    put, read, get = (statistics.median(v) for v in (put_ms, read_ms, get_ms))
    return {"put_ms": put, "put_mbs": size_mb * 1000 / put, "read_ms": read, "read_mbs": size_mb * 1000 / read,
            "get_ms": get, "get_mbs": size_mb * 1000 / get}


class NullTier(Tier):
    """Accounting only: isolates the manager's bookkeeping from any I/O."""

    def __init__(self, name, budget):
        self.name, self._budget, self._sizes = name, budget, {}

    def put(self, key, blob):
        self._sizes[key] = len(blob)

    def get(self, key):
        return b"x" if key in self._sizes else None

    def contains(self, key):
        return key in self._sizes

    def delete(self, key):
        return self._sizes.pop(key, None) is not None

    def keys(self):
        return dict(self._sizes)

    def usage(self):
        return sum(self._sizes.values())

    def capacity(self):
        return self._budget


def bookkeeping_us(index, num_sessions: int = 10_000) -> dict:
    """A turn's tier work outside the tiers themselves: locate + read (restore), then put (offload).
    Half the sessions start on the second tier, so half the turns move a session and write the index."""
    manager = TierManager([NullTier("dram", 1 << 40), NullTier("lmdb", 1 << 40)], index)
    blob = b"\0" * 64
    for i in range(num_sessions):
        manager.put(f"s{i}", blob, tier="lmdb" if i % 2 else None)
    samples = []
    for i in range(2000):
        key = f"s{(i * 7919) % num_sessions}"
        started = time.perf_counter()
        manager.locate(key)
        with manager.read(key):
            pass
        manager.put(key, blob)
        manager.stored_bytes(key)
        samples.append((time.perf_counter() - started) * 1e6)
    return {"median_us": statistics.median(samples), "p99_us": sorted(samples)[int(len(samples) * 0.99)]}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="statekeeper-tiers-"))
    redis_server = RedisServer(work / "redis").start()
    tiers = {
        "dram": DramTier(1 << 40),
        "lmdb": LmdbTier(work / "kv.lmdb", 4 << 30),
        "ssd": SsdTier(work / "files", 4 << 30),
        "redis": RedisTier(redis_server.url, 4 << 30),
    }
    print(f"machine: {machine_line()}; files under {work}\n")
    table = StreamedTable(["tier", "blob", "put ms", "put MB/s", "read ms (restore path)", "read MB/s", "get ms (copy)",
                           "get MB/s"])
    runs = [(name, tier, False) for name, tier in tiers.items()] + [("ssd (cold)", tiers["ssd"], True)]
    for name, tier, cold in runs:
        for size_mb, reps in SIZES.items():
            r = measure(tier, size_mb, reps, cold)
            table.row([name, f"{size_mb} MB", f"{r['put_ms']:.2f}", f"{r['put_mbs']:.0f}", f"{r['read_ms']:.2f}",
                       f"{r['read_mbs']:.0f}", f"{r['get_ms']:.2f}", f"{r['get_mbs']:.0f}"])
    for tier in tiers.values():
        tier.close()
    redis_server.stop()
    print()
    for label, index in (("in-memory index", MemoryTierIndex()), ("durable LMDB index", LmdbTierIndex(work / "index"))):
        cost = bookkeeping_us(index)
        print(f"tier manager bookkeeping per turn ({label}; locate + read + put + stored_bytes, 10,000 sessions, "
              f"no blob I/O): median {cost['median_us']:.1f} µs, p99 {cost['p99_us']:.1f} µs")


if __name__ == "__main__":
    main()
