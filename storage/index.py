"""The durable index of where each key's blob lives (key -> tier name). The tier manager writes it
after a blob is durable in its new tier and before the old copy is removed; at start-up the manager
reconciles it with what the tiers really hold."""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb

log = logging.getLogger(__name__)


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
    def __init__(self, path: Path, map_size: int = 1 << 30):
        path.mkdir(parents=True, exist_ok=True)
        # No fsync per commit: a killed process loses nothing (the pages are in the OS cache); after a
        # power loss the index may lag the tiers and start-up reconciliation settles it: blobs it lost are
        # adopted, and where it picks an older copy that copy is a valid prefix of the history (its
        # token digest is checked), so the rest is recomputed. An fsync per move cost 2 ms at p99.
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=1, sync=False)
        self._failing = False  # the last write failed: the next failure is not logged again
        with self._env.begin() as txn:
            self._entries = {bytes(k).decode(): bytes(v).decode() for k, v in txn.cursor()}

    def set(self, key: str, tier: str) -> None:
        if self._entries.get(key) != tier and self._written(lambda txn: txn.put(key.encode(), tier.encode())):
            self._entries[key] = tier

    def remove(self, key: str) -> None:
        if self._entries.pop(key, None) is not None:
            self._written(lambda txn: txn.delete(key.encode()))

    def _written(self, change) -> bool:
        """Commits one change; a write the index cannot make (its disk or map full) is logged, never raised:
        the blob it records is already written, and start-up reconciliation adopts what the index lost."""
        try:
            with self._env.begin(write=True) as txn:
                change(txn)
        except lmdb.Error as exc:
            if not self._failing:
                log.warning("the tier index cannot be written (%s): start-up will rescan the tiers", exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def close(self) -> None:
        if self._env is not None:
            self._env.sync(True)
            self._env.close()
            self._env = None
