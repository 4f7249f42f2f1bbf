"""Which of several background tasks sends the next job to a model lane: the one with the least work left.

Each next turn's preparation (statekeeper/sessions/next_turn.py) sends its jobs one at a time, the next when the
last has ended. Served as they came, several preparations took turns job by job, so all of them were part done
at once, and a user who came back meanwhile found hers unfinished (on the AVX2 path a quarter of system-last's
returning turns prefilled their history's last exchange again: BENCHMARKS.md). Served shortest remaining work
first, the fewest are unfinished at any time. A task asks for its turn before each job, with its work left as
the rank; the lane's turn passes, once the job has ended, to the lowest rank then waiting, the task that just ran
included (it asks again before the event loop hands the turn on)."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools


class RankedTurns:
    """One job at a time from the tasks that share a lane, lowest rank first, in order of asking at equal ranks.
    Event-loop only (not thread-safe)."""

    def __init__(self):
        self._waiting: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._held = False

    @contextlib.asynccontextmanager
    async def turn(self, rank: float):
        """Held while the caller's job runs. A caller cancelled while it waits leaves the line (a granted turn it
        never used passes on)."""
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._order), granted))
        self._pass_soon()
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # granted, then cancelled before it resumed
                self._release()
            else:
                granted.cancel()  # passed over when the turn is handed on
            raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        self._held = False
        self._pass_soon()

    def _pass_soon(self) -> None:
        # Not at once: a task whose job just ended asks again before the loop runs this, and competes.
        asyncio.get_running_loop().call_soon(self._pass)

    def _pass(self) -> None:
        while not self._held and self._waiting:
            _, _, granted = heapq.heappop(self._waiting)
            if not granted.done():
                self._held = True
                granted.set_result(None)
