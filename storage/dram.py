"""In-process DRAM tier: blobs held as Python buffers under a byte budget."""

from __future__ import annotations

import threading

from storage.base import Buffer, Tier, TierFull


class DramTier(Tier):
    name = "dram"

    def __init__(self, budget_bytes: int):
        self._budget = budget_bytes
        self._blobs: dict[str, Buffer] = {}
        self._used = 0
        self._lock = threading.Lock()

    def put(self, key: str, blob: Buffer) -> None:
        with self._lock:
            old = len(self._blobs.get(key, b""))
            if self._used - old + len(blob) > self._budget:
                raise TierFull(f"dram: {len(blob)} bytes do not fit")
            self._blobs[key] = blob  # kept as given: the encoder hands over a fresh buffer, no copy needed
            self._used += len(blob) - old

    def get(self, key: str) -> Buffer | None:
        return self._blobs.get(key)

    def contains(self, key: str) -> bool:
        return key in self._blobs

    def delete(self, key: str) -> bool:
        with self._lock:
            blob = self._blobs.pop(key, None)
            if blob is None:
                return False
            self._used -= len(blob)
            return True

    def keys(self) -> dict[str, int]:
        return {key: len(blob) for key, blob in list(self._blobs.items())}

    def usage(self) -> int:
        return self._used

    def capacity(self) -> int:
        return self._budget
