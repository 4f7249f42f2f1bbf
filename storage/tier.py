"""The tier interface: a byte store with a budget. Tiers know nothing about KV or torch."""

from __future__ import annotations

from abc import ABC, abstractmethod
import threading
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager

Buffer = bytes | bytearray | memoryview


class TierFull(Exception):
    """The blob does not fit in the tier's budget."""


class TierUnavailable(Exception):
    """The tier cannot be reached right now (a remote tier that is down)."""


class BlobRejected(TierUnavailable):
    """The tier holds bytes for the key that fail its authentication (forged, or another key's blob): they
    are never handed out; like an unreachable copy, the read is a miss and counts as the tier's error."""


class Tier(ABC):
    name: str
    # True when `read` hands out a view whose bytes arrive as they are touched (memory, mmap), so a
    # restore can overlap reading with recompute; False when the whole blob is fetched first (network).
    streams_reads: bool = False
    is_shared = False  # shared with other replicas (Redis): never treat its unknown keys as orphans
    is_volatile = False  # its blobs die with the process (DRAM): a graceful shutdown moves them down

    @abstractmethod
    def put(self, key: str, blob: Buffer) -> None: ...

    @abstractmethod
    def get(self, key: str) -> Buffer | None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> bool: ...

    @abstractmethod
    def keys(self) -> dict[str, int]:
        """Every stored key with its size in bytes."""

    @abstractmethod
    def usage(self) -> int: ...

    @abstractmethod
    def capacity(self) -> int: ...

    @contextmanager
    def read(self, key: str) -> Iterator[Buffer | None]:
        """Like get, but the buffer may be zero-copy and is valid only inside the block."""
        yield self.get(key)

    @abstractmethod
    def overdraft(self, size: int) -> AbstractContextManager[None]:
        """Lets one write of `size` bytes land over the budget (the tier manager makes room after a write
        succeeded, so a write that fails has demoted or evicted nothing)."""

    @property
    def available(self) -> bool:
        """False while a remote tier cannot be reached (it reconnects by itself); a local one always is."""
        return True

    def ping(self) -> bool:
        """Checks the connection now (the dashboard's sampling keeps a remote tier's warm)."""
        return True

    def holds_which(self, keys: list[str]) -> set[str]:
        """Of `keys`, those the store itself holds now, asked of it (contains answers from this process's books,
        which a shared tier's other writers and its TTL leave behind)."""
        return {key for key in keys if self.contains(key)}

    def refresh_usage(self) -> None:
        """A shared tier reads again what it holds (other replicas' deletes, its TTL), where its books say it
        is full; a tier only this process writes knows already."""

    def recognize(self, keys: Iterable[str]) -> None:
        """Keys the caller knows of (the durable index's). A tier whose stored names hide the keys (Redis)
        lists in `keys` only those it was told of or wrote itself."""

    def close(self) -> None:
        pass


class SizedTier(Tier):
    """Keeps each key's size and the byte total in memory, against a budget; subclasses move bytes."""

    def __init__(self, budget_bytes: int, sizes: dict[str, int] | None = None):
        self._budget = budget_bytes
        self._sizes: dict[str, int] = dict(sizes or {})
        self._used = sum(self._sizes.values())
        self._accounting = threading.RLock()  # a subclass's bookkeeping wraps the base's in one step

    def _check_room(self, key: str, size: int) -> None:
        with self._accounting:
            if self._used - self._sizes.get(key, 0) + size > self._budget:
                raise TierFull(f"{self.name}: {size} bytes do not fit")

    @contextmanager
    def overdraft(self, size: int) -> Iterator[None]:
        """Lets one write of `size` bytes land over the budget: the tier manager makes room only after the
        write succeeded, so a write that fails has demoted or evicted nothing."""
        with self._accounting:
            self._budget += size
        try:
            yield
        finally:
            with self._accounting:
                self._budget -= size

    def _record(self, key: str, size: int) -> None:
        with self._accounting:
            self._used += size - self._sizes.get(key, 0)
            self._sizes[key] = size

    def _forget(self, key: str) -> int | None:
        with self._accounting:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._used -= size
            return size

    def contains(self, key: str) -> bool:
        return key in self._sizes

    def keys(self) -> dict[str, int]:
        with self._accounting:
            return dict(self._sizes)

    def usage(self) -> int:
        return self._used

    def capacity(self) -> int:
        return self._budget
