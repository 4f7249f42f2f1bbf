"""In-process DRAM tier: blobs held as Python buffers under a byte budget."""

from __future__ import annotations

from storage.tier import Buffer, SizedTier


class DramTier(SizedTier):
    name = "dram"
    is_volatile = True
    streams_reads = True

    def __init__(self, budget_bytes: int):
        super().__init__(budget_bytes)
        self._blobs: dict[str, Buffer] = {}

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        self._blobs[key] = blob  # kept as given: the encoder hands over a fresh buffer, no copy needed
        self._record(key, len(blob))

    def get(self, key: str) -> Buffer | None:
        return self._blobs.get(key)

    def delete(self, key: str) -> bool:
        self._blobs.pop(key, None)
        return self._forget(key) is not None
