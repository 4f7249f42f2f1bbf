"""A graceful stop: the active KV goes to storage so that a restart restores instead of recomputing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.placement import Placement
from storage.manager import TierManager

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownReport:
    stored: int  # active states stored before the deadline
    cut: int  # not stored by the deadline: recomputed from their history after the restart
    failed: int  # their store failed: recomputed as well
    moved: int = 0  # stored states moved out of the tiers that die with the process (DRAM)


async def store_before_exit(active: list[LiveSession], placement: Placement, tiers: TierManager,
                            in_io_thread: Callable[..., Awaitable], deadline: float) -> ShutdownReport:
    """Stores the active KV by `deadline` (time.monotonic()), exact and uncompressed (no scoring), every session at once on
    the I/O threads, into the first tier that outlives the process; then what DRAM holds moves down there
    too. What is not stored by the deadline is cut: its history is safe and its next turn recomputes."""
    timeout = max(0.0, deadline - time.monotonic())
    durable = tiers.durable_tier()
    offloads = [asyncio.ensure_future(placement.store(live, durable)) for live in active]
    done, cut = await asyncio.wait(offloads, timeout=timeout) if offloads else (set(), set())
    for task in cut:
        task.cancel()
    await asyncio.gather(*cut, return_exceptions=True)
    moved = await in_io_thread(tiers.save_volatile, deadline)
    report = ShutdownReport(stored=sum(1 for task in done if task.exception() is None), cut=len(cut),
                            failed=sum(1 for task in done if task.exception() is not None), moved=moved)
    log.info("shutdown: %d active states stored, %d stored states moved out of memory", report.stored, moved)
    if report.cut or report.failed:
        log.warning("shutdown: %d active states cut by the deadline, %d failed; those will be recomputed from "
                    "their history", report.cut, report.failed)
    return report
