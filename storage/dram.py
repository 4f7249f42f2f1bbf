"""In-process DRAM tier: blobs held as Python buffers under a byte budget."""

from __future__ import annotations

from collections.abc import Callable

from storage.tier import Buffer, SizedTier


class DramTier(SizedTier):
    name = "dram"
    is_volatile = True
    streams_reads = True

    def __init__(self, budget_bytes: int, buffer: Callable[[int], memoryview] | None = None):
        """`buffer(size)`: where each blob is copied to instead of being kept as given (a GPU worker's
        service passes page-locked memory, so a restore copies a blob to the device without first staging
        it: kernels/device_copy.py `pinned_host_buffer`)."""
        super().__init__(budget_bytes)
        self._blobs: dict[str, Buffer] = {}
        self._buffer = buffer

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        if self._buffer is not None:
            source = memoryview(blob).cast("B")
            held = self._buffer(source.nbytes)
            held[:] = source
            blob = held
        self._blobs[key] = blob  # otherwise kept as given: the encoder hands over a fresh buffer, no copy needed
        self._record(key, len(blob))

    def get(self, key: str) -> Buffer | None:
        return self._blobs.get(key)

    def delete(self, key: str) -> bool:
        self._blobs.pop(key, None)
        return self._forget(key) is not None
