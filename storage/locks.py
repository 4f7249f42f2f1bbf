"""A shared/exclusive lock: many holders of the shared side at once, or one of the exclusive side."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class SharedLock:
    """Writers waiting for the exclusive side go first: new shared holders wait behind them, so a steady
    stream of readers cannot starve it. A thread that already holds the shared side takes it again at
    once (waiting there for the exclusive side would wait for itself)."""

    def __init__(self):
        self._condition = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting_exclusive = 0
        self._mine = threading.local()

    @contextmanager
    def shared(self) -> Iterator[None]:
        held = getattr(self._mine, "count", 0)
        with self._condition:
            if not held:
                self._condition.wait_for(lambda: not self._exclusive and not self._waiting_exclusive)
            self._shared += 1
        self._mine.count = held + 1
        try:
            yield
        finally:
            self._mine.count = held
            with self._condition:
                self._shared -= 1
                if not self._shared:
                    self._condition.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._condition:
            self._waiting_exclusive += 1
            self._condition.wait_for(lambda: not self._exclusive and not self._shared)
            self._waiting_exclusive -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._condition:
                self._exclusive = False
                self._condition.notify_all()
