"""The tier interface: a byte store with a budget. Tiers know nothing about KV or torch."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

Buffer = bytes | bytearray | memoryview


class TierFull(Exception):
    """The blob does not fit in the tier's budget."""


class TierUnavailable(Exception):
    """The tier cannot be reached right now (a remote tier that is down)."""


class Tier(ABC):
    name: str

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

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> None:
        for key, blob in items:
            self.put(key, blob)

    def get_many(self, keys: Iterable[str]) -> list[Buffer | None]:
        return [self.get(key) for key in keys]

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(self.delete(key) for key in keys)

    def close(self) -> None:
        pass
