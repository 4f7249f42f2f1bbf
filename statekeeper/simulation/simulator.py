"""The placement simulator (issue 32): a trace's turns (simulation/trace.py) drive the service's own tier
manager and eviction policy (storage/manager.py, storage/policy.py), over tiers that keep only sizes, with the
service's lifecycle around them: after a turn a conversation stays in the worker (active) for idle_offload_s,
then its KV goes to storage as one blob of its tokens' bytes, which lands where the manager puts it and moves
down or out as the manager decides. A later turn restores nothing if the conversation is still active, reads
its blob from the tier that holds it, or, its blob evicted, recomputes its whole history. With compress_after_s
set, stored blobs are compressed when the service's compactor (sessions/offload.py) would: that long after
their offload, or all at once when the fastest tier passes FULL_FRACTION of its budget; put again,
compression_ratio times smaller, from the fastest tier down. Compression takes no time here.

What is not modelled yet: compression's CPU time (the compactor falls behind under load), the active pool's
budget, restore and prefill times (a cost profile), and any policy but the one given."""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from statekeeper.sessions.offload import FULL_FRACTION
from statekeeper.simulation.trace import TraceTurn
from storage.manager import TierManager
from storage.policy import EvictionPolicy, LruPolicy
from storage.tier import SizedTier

ACTIVE, RECOMPUTE = "active", "recompute"


class SizeOnly:
    """Stands in for a blob: the manager and the tiers read only its length."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


class SimulatedTier(SizedTier):
    """A tier with the real byte budget and accounting (storage/tier.py SizedTier) that stores no bytes."""

    def __init__(self, name: str, budget_bytes: int):
        super().__init__(budget_bytes)
        self.name = name

    def put(self, key: str, blob) -> None:
        self._check_room(key, len(blob))
        self._record(key, len(blob))

    def get(self, key: str) -> SizeOnly | None:
        size = self._sizes.get(key)
        return None if size is None else SizeOnly(size)

    def delete(self, key: str) -> bool:
        return self._forget(key) is not None


@dataclass(frozen=True, slots=True)
class SimulationConfig:
    tiers: list[tuple[str, int]]  # (name, budget in bytes), fastest first
    bytes_per_token: int  # the stored KV's, as the model and its KV dtype make it
    idle_offload_s: float = 300.0  # IDLE_OFFLOAD_SECONDS
    compress_after_s: float | None = None  # COMPRESS_AFTER_SECONDS; None: blobs stay exact
    compression_ratio: float = 8.0  # exact bytes over compressed (the default codec's, BENCHMARKS.md issue 13)


@dataclass(slots=True)
class SimulationReport:
    turns: int = 0
    resumed: Counter = field(default_factory=Counter)  # source (active, a tier's name, recompute) -> turns
    history_tokens: Counter = field(default_factory=Counter)  # source -> history tokens those turns resumed
    tier_bytes: dict[str, int] = field(default_factory=dict)  # at the trace's end
    demotions: int = 0
    evictions: int = 0
    compressed: int = 0
    seconds: float = 0.0  # the simulation's own wall time

    @property
    def recomputed_tokens(self) -> int:
        return self.history_tokens[RECOMPUTE]

    def as_dict(self) -> dict:
        return {"turns": self.turns, "resumed": dict(self.resumed), "history_tokens": dict(self.history_tokens),
                "recomputed_tokens": self.recomputed_tokens, "tier_bytes": self.tier_bytes,
                "demotions": self.demotions, "evictions": self.evictions, "compressed": self.compressed,
                "seconds": self.seconds}


def simulate(turns: Iterable[TraceTurn], config: SimulationConfig, policy: EvictionPolicy | None = None
             ) -> SimulationReport:
    """Runs `turns` (in time order) through a TierManager over SimulatedTiers with `policy` (LRU by default)."""
    started = time.perf_counter()
    manager = TierManager([SimulatedTier(name, budget) for name, budget in config.tiers], policy=policy or LruPolicy())
    tokens: dict[str, int] = {}  # conversation -> its history's tokens
    offload_at: dict[str, float] = {}  # active conversation -> when it goes to storage
    compress_at: dict[str, float] = {}  # stored exact conversation -> when it is compressed
    due: list[tuple[float, str, str]] = []  # (time, event, conversation), a heap; stale entries are skipped
    report = SimulationReport()
    fastest = manager.tiers[0]

    def compress(conversation: str) -> None:
        del compress_at[conversation]
        if manager.locate(conversation) is not None:  # still stored: else evicted meanwhile
            exact = tokens[conversation] * config.bytes_per_token
            manager.put(conversation, SizeOnly(max(1, round(exact / config.compression_ratio))))
            report.compressed += 1

    def compress_if_full() -> None:
        """The compactor's other rule (Compactor.due): past FULL_FRACTION of the fastest tier, every stored
        exact blob is due, oldest first. (A demoted one is due too; a demotion out of the fastest tier only
        happens when it is full, so that case is this one here.)"""
        if compress_at and fastest.usage() >= FULL_FRACTION * fastest.capacity():
            for conversation in sorted(compress_at, key=compress_at.get):
                compress(conversation)

    def events_until(now: float) -> None:
        while due and due[0][0] <= now:
            when, event, conversation = heapq.heappop(due)
            if event == "offload" and offload_at.get(conversation) == when:  # not pushed back by a later turn
                del offload_at[conversation]
                exact = tokens[conversation] * config.bytes_per_token
                if manager.put(conversation, SizeOnly(exact)) is not None and config.compress_after_s is not None:
                    compress_at[conversation] = when + config.compress_after_s
                    heapq.heappush(due, (compress_at[conversation], "compress", conversation))
                    compress_if_full()
            elif event == "compress" and compress_at.get(conversation) == when:
                compress(conversation)

    for turn in turns:
        events_until(turn.time_s)
        report.turns += 1
        history = tokens.get(turn.conversation, 0)
        if history:
            source = ACTIVE if turn.conversation in offload_at else _stored_source(manager, turn.conversation)
            report.resumed[source] += 1
            report.history_tokens[source] += history
        tokens[turn.conversation] = history + turn.prompt_tokens + turn.reply_tokens
        compress_at.pop(turn.conversation, None)  # active again: its next offload stores it exact
        offload_at[turn.conversation] = turn.time_s + config.idle_offload_s
        heapq.heappush(due, (offload_at[turn.conversation], "offload", turn.conversation))
    for stats in manager.stats():
        report.tier_bytes[stats["name"]] = stats["usage_bytes"]
        report.demotions += stats["demotions"]
        report.evictions += stats["evictions"]
    report.seconds = time.perf_counter() - started
    return report


def _stored_source(manager: TierManager, conversation: str) -> str:
    """Where a resumed conversation's KV comes from, read as the service reads it (which refreshes its
    recency); recompute where no tier holds it."""
    with manager.read(conversation) as (tier, blob):
        return RECOMPUTE if blob is None else tier
