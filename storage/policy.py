"""Which blob leaves a full tier first. LRU by default; the expected-value policy (statekeeper/placement/)
plugs in through the same three methods, and hears of every placement to keep books of its own."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    def choose_victim(self, tier: int, entries: OrderedDict[str, int]) -> str:
        """`tier`: the full tier's position, fastest first; `entries`: its key -> size in bytes, least
        recently used first. Returns the key to move down (or out, from the last tier)."""

    def keep_first(self, tier: int, entries: OrderedDict[str, int]) -> list[str]:
        """The tier's keys, those most worth keeping first (the order a shutdown saves them in)."""

    def placed(self, tier: int, key: str, size: int) -> None:
        """The key's blob now lives in `tier`."""

    def taken(self, tier: int, key: str) -> None:
        """The key's blob left `tier` (moved, replaced or deleted)."""


class LruPolicy:
    def choose_victim(self, tier: int, entries: OrderedDict[str, int]) -> str:
        return next(iter(entries))

    def keep_first(self, tier: int, entries: OrderedDict[str, int]) -> list[str]:
        return list(reversed(entries))

    def placed(self, tier: int, key: str, size: int) -> None:
        pass

    def taken(self, tier: int, key: str) -> None:
        pass
