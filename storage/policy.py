"""Which blob leaves a full tier first. LRU today; a cost-aware policy (bytes freed per second of
recompute it would cost) plugs in through the same method."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionPolicy(Protocol):
    def choose_victim(self, entries: OrderedDict[str, int]) -> str:
        """`entries`: key -> size in bytes, least recently used first. Returns the key to move down."""


class LruPolicy:
    def choose_victim(self, entries: OrderedDict[str, int]) -> str:
        return next(iter(entries))
