"""LMDB tier: a local memory-mapped store. Reads are zero-copy views of the map; the map grows on demand
(doubling) up to the budget plus B-tree overhead, so a growing store never fails a write it has room for."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb

from storage.tier import Buffer, SizedTier, TierFull
from storage.locks import SharedLock

_INITIAL_MAP = 64 << 20
_OVERHEAD = 1.1  # page headers and B-tree pages on top of the values themselves


class LmdbTier(SizedTier):
    name = "lmdb"
    streams_reads = True

    def __init__(self, path: Path, budget_bytes: int):
        self._max_map = int(budget_bytes * _OVERHEAD) + (16 << 20)
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=min(_INITIAL_MAP, self._max_map), max_dbs=1, readahead=False)
        # Reads and writes run side by side (LMDB: readers never block the one writer); only growing the
        # map, which needs no transaction in flight in this process, takes it alone.
        self._lock = SharedLock()
        with self._env.begin(buffers=True) as txn:
            super().__init__(budget_bytes, {bytes(k).decode(): len(v) for k, v in txn.cursor()})

    def _grow(self, needed: int) -> None:
        with self._lock.exclusive():
            size = self._env.info()["map_size"]
            if size >= self._max_map:
                raise TierFull("lmdb: map is at its maximum size")
            self._env.set_mapsize(min(self._max_map, max(size * 2, size + 2 * needed)))

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        while True:
            try:
                with self._lock.shared(), self._env.begin(write=True) as txn:
                    txn.put(key.encode(), blob)
                break
            except lmdb.MapFullError:
                self._grow(len(blob))
        self._record(key, len(blob))

    def get(self, key: str) -> Buffer | None:
        with self._lock.shared(), self._env.begin() as txn:
            return txn.get(key.encode())

    @contextmanager
    def read(self, key: str) -> Iterator[Buffer | None]:
        with self._lock.shared(), self._env.begin(buffers=True) as txn:
            yield txn.get(key.encode())

    def delete(self, key: str) -> bool:
        with self._lock.shared():
            with self._env.begin(write=True) as txn:
                found = txn.delete(key.encode())
            self._forget(key)
            return found

    def close(self) -> None:
        self._env.close()
