"""The service's work that no request asks for: the sweep (what other replicas deleted, idle and over-budget
KV, idle conversations beyond the bounds, freed memory given back once quiet), the compression of stored
blobs (sessions/offload.py), and a sample of the stats for the dashboard's charts; and the fire-and-forget
tasks requests leave behind (a promotion toward the worker, a budget check after a turn)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from statekeeper.config import SessionConfig
from statekeeper.dashboard import StatsHistory
from statekeeper.memory import FreedMemory
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.offload import Compactor
from statekeeper.sessions.registry import SessionRegistry
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.turn_runner import TurnRunner
from storage.manager import TierManager

log = logging.getLogger(__name__)
# How often the sweep takes out of the books what a shared tier (Redis) dropped on its own: each look reads
# the tier's whole record of what it holds (storage/redis_tier.py refresh_usage).
SHARED_TIER_CHECK_S = 60.0


class BackgroundWork:
    def __init__(self, config: SessionConfig, sessions: SessionRegistry, replicas: ReplicaSync,
                 turn_runner: TurnRunner, compactor: Compactor, tiers: TierManager, executors: Executors,
                 stats: Callable[[], dict], sweep_retention: Callable[[], Awaitable[None]]):
        """`stats()`: the service's, sampled for the dashboard's charts; `sweep_retention()` takes up the tenants'
        retention defaults another replica set and drops the stored KV whose retention TTL has passed."""
        self.config = config
        self.sessions = sessions
        self.replicas = replicas
        self.turn_runner = turn_runner
        self.compactor = compactor
        self.tiers = tiers
        self.executors = executors
        self._stats = stats
        self._sweep_retention = sweep_retention
        self.stats_history = StatsHistory(config.dashboard_sample_seconds)  # GET /v1/admin/history
        self.freed_memory = FreedMemory()
        self._shared_checked_at = -math.inf
        self._loops: list[asyncio.Task] = []
        self._tasks: set[asyncio.Future] = set()

    def start(self) -> None:
        self._loops = [asyncio.create_task(self._sweep_forever()), asyncio.create_task(self.compactor.run_forever()),
                       asyncio.create_task(self._sample_forever())]

    def start_loop(self, loop: Awaitable) -> None:
        """Runs one more loop of the service's (DateRollover's) until stop()."""
        self._loops.append(asyncio.ensure_future(loop))

    async def stop(self) -> None:
        """Ends the loops, and waits for the tasks requests left behind."""
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, *self._tasks, return_exceptions=True)

    def spawn(self, awaitable: Awaitable) -> None:
        """Runs `awaitable` without waiting for it; shutdown waits for it."""
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def sweep(self) -> None:
        """Forgets what other replicas deleted, offloads idle and over-budget KV, lets idle conversations
        beyond the bounds leave memory (sessions/registry.py), takes up the retention defaults set at run time
        (here or on another replica), drops stored KV past its retention TTL, takes what a shared tier dropped on
        its own out of the books (every SHARED_TIER_CHECK_S), and gives freed memory back once quiet."""
        await self.replicas.forget_deleted(list(self.sessions))
        await self.sessions.sweep()
        await self._sweep_retention()
        if time.monotonic() - self._shared_checked_at >= SHARED_TIER_CHECK_S:
            self._shared_checked_at = time.monotonic()
            await self.executors.in_io_thread(self.tiers.forget_gone)
        await self._give_back_memory()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_seconds)
            try:
                await self.sweep()
            except Exception:  # one failed sweep (a store down) must not end the offloads, budgets and expiries
                log.exception("the sweep failed; the next one runs in %s s", self.config.sweep_interval_seconds)

    async def _give_back_memory(self) -> None:
        """Once no turn has run for give_back_memory_after_seconds, the memory the last busy spell left freed
        goes back to the kernel (statekeeper/memory.py): while turns run, it is kept for their KV."""
        quiet_for = time.monotonic() - self.turn_runner.last_turn_ended
        if self.turn_runner.in_progress or quiet_for < self.config.give_back_memory_after_seconds:
            return
        await self.executors.in_io_thread(self.freed_memory.give_back)

    async def _sample_forever(self) -> None:
        """One sample of the stats for the dashboard's charts every `dashboard_sample_seconds`. A reachable
        tier that can be pinged (Redis) is pinged first: an outage shows as unavailable within a sample even
        when no request touched the tier (a failed ping marks it down; it reconnects in the background)."""
        while True:
            await asyncio.sleep(self.stats_history.interval_s)
            try:
                await self.executors.in_io_thread(self._ping_tiers)
                self.stats_history.sample(self._stats())
            except Exception:  # a tier that cannot answer now: the next sample tries again
                log.exception("sampling the stats for the dashboard failed")

    def _ping_tiers(self) -> None:
        for tier in self.tiers.tiers:
            if tier.available:
                tier.ping()
