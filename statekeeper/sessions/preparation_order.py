"""The order in which next turns' preparations (sessions/next_turn.py) take a background lane. Each job of a
preparation is submitted once the one before it is done, so several preparations on one lane took jobs in
turns and all of them were half done when their users came back on a busy CPU (benchmarks/chat_shapes.py: six
users' first turns, each kept the same few rows). One at a time, lowest order first (the time its turn began:
the user likely back first is prepared first), each is whole sooner, and a turn that comes back before its
own is reached computes what any turn would without it."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable


@dataclasses.dataclass(order=True)
class _Place:
    order: float
    number: int  # places of one order keep the order they were taken in
    ready: asyncio.Event = dataclasses.field(compare=False, default_factory=asyncio.Event)


class PreparationOrder:
    def __init__(self):
        self._lines: dict[int, list[_Place]] = collections.defaultdict(list)  # by lane, lowest order first
        self._numbers = itertools.count()

    @contextlib.asynccontextmanager
    async def place(self, lane: int, order: float | None = None) -> AsyncIterator[Callable[[], Awaitable[None]]]:
        """A place in background lane `lane`'s line, at `order` (by default now: after those waiting) while the
        work inside runs: it awaits the callable it is given before each job, which returns once no place lower
        in the line is held. A preparation holds a place only while it has jobs to run (an early head waiting for
        its reply's next tokens leaves it), so that no one waits for a place that runs nothing."""
        place = _Place(time.monotonic() if order is None else order, next(self._numbers))
        line = self._lines[lane]
        bisect.insort(line, place)

        async def my_turn() -> None:
            while line[0] is not place:
                place.ready.clear()
                await place.ready.wait()

        try:
            yield my_turn
        finally:  # nothing awaited here: a cancelled preparation leaves at once
            line.remove(place)
            if line:
                line[0].ready.set()
            else:
                del self._lines[lane]

