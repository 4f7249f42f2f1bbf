"""Tier manager: ordered tiers with byte budgets and LRU demotion. Plain Python, no torch.

Policy (README "Storage tiers"): a new blob lands in the fastest tier it fits in; to make room the least
recently used blobs of that tier move one tier down; the last tier evicts (the conversation history stays,
so an evicted state is recomputed). A blob is written to its new tier before it is removed from the old
one, so a crash between the two leaves two copies, never none."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from storage.base import Buffer, Tier, TierFull

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    demotions: int = 0
    evictions: int = 0
    errors: int = 0


class TierManager:
    def __init__(self, tiers: list[Tier]):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = tiers
        self._lock = threading.RLock()
        # Per tier, keys in least-recently-used order with their sizes; rebuilt from the tiers at start.
        self._lru: list[OrderedDict[str, int]] = [OrderedDict(tier.keys()) for tier in tiers]
        self._stats = [TierStats() for _ in tiers]

    def locate(self, key: str) -> str | None:
        index = self._index_of(key)
        return None if index is None else self.tiers[index].name

    def stored_bytes(self, key: str) -> int | None:
        index = self._index_of(key)
        return None if index is None else self._lru[index][key]

    def _index_of(self, key: str) -> int | None:
        return next((i for i, lru in enumerate(self._lru) if key in lru), None)

    def put(self, key: str, blob: Buffer, tier: str | None = None) -> str | None:
        """Stores the blob in the fastest tier with room (or from `tier` down); returns the tier it landed
        in, or None when no tier can hold it."""
        with self._lock:
            previous = self._index_of(key)
            start = 0 if tier is None else [t.name for t in self.tiers].index(tier)
            landed = self._put_from(start, key, blob)
            if previous is not None and previous != landed:
                self._remove(previous, key)
            return None if landed is None else self.tiers[landed].name

    def _put_from(self, start: int, key: str, blob: Buffer) -> int | None:
        for index in range(start, len(self.tiers)):
            tier = self.tiers[index]
            if len(blob) > tier.capacity():
                continue
            self._lru[index].pop(key, None)
            while self._lru[index] and tier.usage() + len(blob) > tier.capacity():
                self._demote(index, next(iter(self._lru[index])))
            try:
                tier.put(key, blob)
            except TierFull:
                continue
            except Exception:
                self._stats[index].errors += 1
                log.exception("tier %s failed to store %s", tier.name, key)
                continue
            self._lru[index][key] = len(blob)
            return index
        return None

    def _demote(self, index: int, key: str) -> None:
        blob = self.tiers[index].get(key)
        landed = None if blob is None else self._put_from(index + 1, key, blob)
        if landed is None:
            self._stats[index].evictions += 1
        else:
            self._stats[index].demotions += 1
        self._remove(index, key)

    def _remove(self, index: int, key: str) -> None:
        self._lru[index].pop(key, None)
        self.tiers[index].delete(key)

    @contextmanager
    def read(self, key: str) -> Iterator[tuple[str | None, Buffer | None]]:
        """Yields (tier name, buffer); the buffer may be a zero-copy view valid only inside the block."""
        with self._lock:
            index = self._index_of(key)
            if index is None:
                yield None, None
                return
            self._lru[index].move_to_end(key)
        tier = self.tiers[index]
        with tier.read(key) as blob:
            stats = self._stats[index]
            if blob is None:
                stats.misses += 1
                with self._lock:
                    self._lru[index].pop(key, None)
            else:
                stats.hits += 1
            yield tier.name, blob

    def record_error(self, tier_name: str) -> None:
        """A blob read from this tier failed validation."""
        self._stats[[t.name for t in self.tiers].index(tier_name)].errors += 1

    def delete(self, key: str) -> None:
        with self._lock:
            for index, lru in enumerate(self._lru):
                if key in lru:
                    self._remove(index, key)

    def keys(self) -> set[str]:
        return {key for lru in self._lru for key in lru}

    def stats(self) -> list[dict]:
        return [
            {
                "name": tier.name,
                "usage_bytes": tier.usage(),
                "budget_bytes": tier.capacity(),
                "blobs": len(lru),
                **asdict(stats),
            }
            for tier, lru, stats in zip(self.tiers, self._lru, self._stats)
        ]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
