"""The durable index of where each key's blob lives (key -> tier name). The tier manager writes it
after a blob is durable in its new tier and before the old copy is removed; at start-up the manager
reconciles it with what the tiers really hold."""

from __future__ import annotations

from pathlib import Path

import lmdb


class MemoryTierIndex:
    """For tests and for deployments that want no durable index (every tier scanned at start)."""

    def __init__(self):
        self._entries: dict[str, str] = {}

    def load(self) -> dict[str, str]:
        return dict(self._entries)

    def set(self, key: str, tier: str) -> None:
        self._entries[key] = tier

    def remove(self, key: str) -> None:
        self._entries.pop(key, None)

    def close(self) -> None:
        pass


class LmdbTierIndex(MemoryTierIndex):
    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        # No fsync per commit: a killed process loses nothing (the pages are in the OS cache); after a
        # power loss the index may lag the tiers and start-up reconciliation settles it: blobs it lost are
        # adopted, and where it picks an older copy that copy is a valid prefix of the history (its
        # token digest is checked), so the rest is recomputed. An fsync per move cost 2 ms at p99.
        self._env = lmdb.open(str(path), map_size=1 << 30, max_dbs=1, sync=False)
        with self._env.begin() as txn:
            self._entries = {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor()}

    def set(self, key: str, tier: str) -> None:
        if self._entries.get(key) != tier:
            with self._env.begin(write=True) as txn:
                txn.put(key.encode(), tier.encode())
            self._entries[key] = tier

    def remove(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            with self._env.begin(write=True) as txn:
                txn.delete(key.encode())

    def close(self) -> None:
        if self._env is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None
