"""The placement simulator (issue 32): a trace's turns (placement/trace.py) drive the service's own tier
manager and placement policy (storage/manager.py; storage/policy.py's LRU or statekeeper/placement/'s
expected-value policy), over tiers that keep only sizes, with the service's lifecycle around them: after a
turn a conversation stays in the worker (active) for idle_offload_s, then its KV goes to storage as one exact
blob of its tokens' bytes, which lands where the manager puts it and moves down or out as the policy decides.
A later turn restores nothing if the conversation is still active, reads its blob from the tier that holds
it, or, its blob evicted, recomputes its whole history.

Compression, as the service's compactor does it (sessions/offload.py), on compress_workers cores that each
take a blob's compress_cpu_ms (the cost profile's) and fall behind when blobs come faster:
    none       blobs stay exact
    scheduled  a blob is due compress_after_s after its offload, or at once when the fastest tier passes
               FULL_FRACTION of its budget; due blobs oldest first
    value      the expected-value policy picks which blobs to compress and in what order
A turn for a conversation whose blob is being compressed cancels the job (its CPU is wasted). The
compressed blob is put again, compression_ratio times smaller, from the fastest tier down.

First tokens are estimated from the cost profile: a resumed turn pays its blob's restore (read and, if
compressed, decode) or its history's recompute, then its new message's prefill."""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from statekeeper.placement.costs import CostProfile
from statekeeper.placement.policy import FULL_FRACTION, ValuePolicy
from statekeeper.placement.trace import TraceTurn
from storage.manager import TierManager
from storage.policy import LruPolicy
from storage.tier import SizedTier

ACTIVE, RECOMPUTE = "active", "recompute"
POLICIES = ("lru", "value")
COMPRESSIONS = ("none", "scheduled", "value")


def service_compression(policy: str, lossless: bool = False) -> str:
    """How the service compresses under `policy`: a lossless compression has nothing to compress (under either
    policy: the live service schedules none), else the value policy decides and LRU follows the schedule."""
    return "none" if lossless else "value" if policy == "value" else "scheduled"


def hit_rate(resumed: Mapping[str, int]) -> float | None:
    """The share of resumed turns that found their KV (in memory or a tier); None without a resumed turn."""
    total = sum(resumed.values())
    return 1.0 - resumed.get(RECOMPUTE, 0) / total if total else None


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
    profile: CostProfile
    idle_offload_s: float = 300.0  # IDLE_OFFLOAD_SECONDS
    policy: str = "lru"  # POLICIES
    compression: str = "none"  # COMPRESSIONS
    compress_after_s: float = 600.0  # COMPRESS_AFTER_SECONDS, for compression "scheduled"
    sample_every_s: float = 3_600.0  # bytes per tier over time
    record_turns: bool = False  # keep every turn's restore source, in trace order (SimulationReport.turn_sources)

    def __post_init__(self):
        if self.policy not in POLICIES or self.compression not in COMPRESSIONS:
            raise ValueError(f"policy is one of {POLICIES}, compression one of {COMPRESSIONS}")
        if self.compression == "value" and self.policy != "value":
            raise ValueError("compression 'value' is the value policy's")


@dataclass(slots=True)
class SimulationReport:
    turns: int = 0
    resumed: Counter = field(default_factory=Counter)  # source (active, a tier's name, recompute) -> turns
    history_tokens: Counter = field(default_factory=Counter)  # source -> history tokens those turns resumed
    compressed_restores: int = 0
    recompute_ms: float = 0.0  # the recomputed histories' prefill time, by the cost profile
    first_token_ms: list[float] = field(default_factory=list)  # resumed turns', estimated
    turn_sources: list[str] = field(default_factory=list)  # with record_turns: each turn's ("first" if none)
    tier_bytes: dict[str, int] = field(default_factory=dict)  # at the trace's end
    tier_bytes_over_time: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    demotions: int = 0
    evictions: int = 0
    compressed: int = 0
    compress_cancelled: int = 0
    compress_cpu_s: float = 0.0  # of jobs that finished or were cancelled
    compress_wasted_cpu_s: float = 0.0  # cancelled jobs', and finished ones' whose blob was gone meanwhile
    compress_backlog_max: int = 0
    compress_backlog_end: int = 0
    policy: dict = field(default_factory=dict)
    seconds: float = 0.0  # the simulation's own wall time

    @property
    def recomputed_tokens(self) -> int:
        return self.history_tokens[RECOMPUTE]

    def first_token_percentile(self, share: float) -> float:
        values = sorted(self.first_token_ms)
        return values[min(len(values) - 1, math.ceil(share * len(values)) - 1)] if values else 0.0

    def as_dict(self) -> dict:
        return {"turns": self.turns, "resumed": dict(self.resumed), "history_tokens": dict(self.history_tokens),
                "recomputed_tokens": self.recomputed_tokens, "compressed_restores": self.compressed_restores,
                "recompute_ms": round(self.recompute_ms),
                "first_token_ms_p50": round(self.first_token_percentile(0.5), 1),
                "first_token_ms_p95": round(self.first_token_percentile(0.95), 1),
                "tier_bytes": self.tier_bytes, "tier_bytes_over_time": self.tier_bytes_over_time,
                "demotions": self.demotions, "evictions": self.evictions, "compressed": self.compressed,
                "compress_cancelled": self.compress_cancelled, "compress_cpu_s": round(self.compress_cpu_s, 1),
                "compress_wasted_cpu_s": round(self.compress_wasted_cpu_s, 1),
                "compress_backlog_max": self.compress_backlog_max, "compress_backlog_end": self.compress_backlog_end,
                "policy_report": self.policy, "seconds": round(self.seconds, 1)}


def simulate(turns: Iterable[TraceTurn], config: SimulationConfig) -> SimulationReport:
    """Runs `turns` through a TierManager over SimulatedTiers with the configured policy, in the order of their
    times (a service writes each turn when it ends, so its trace is nearly, not quite, in that order)."""
    return _Simulation(config).run(sorted(turns, key=lambda turn: turn.time_s))


class _Simulation:
    def __init__(self, config: SimulationConfig):
        self.config = config
        self.profile = config.profile
        self.now = 0.0
        names = [name for name, _ in config.tiers]
        self.value_policy = (ValuePolicy(self.profile, names, clock=lambda: self.now)
                             if config.policy == "value" else None)
        self.manager = TierManager([SimulatedTier(name, budget) for name, budget in config.tiers],
                                   policy=self.value_policy or LruPolicy())
        self.fastest = self.manager.tiers[0]
        self.report = SimulationReport()
        self.tokens: dict[str, int] = {}  # conversation -> its history's tokens
        self.turn_counts: Counter = Counter()
        self.offload_at: dict[str, float] = {}  # active conversation -> when it goes to storage
        self.compressed: set[str] = set()  # stored conversations whose blob is compressed
        self.events: list[tuple[float, int, str, str]] = []  # (time, number, event, conversation), a heap
        self.numbers = itertools.count()
        self.compactor = _Compactor(self)

    def at(self, when: float, event: str, conversation: str) -> None:
        heapq.heappush(self.events, (when, next(self.numbers), event, conversation))

    def run(self, turns: Iterable[TraceTurn]) -> SimulationReport:
        started = time.perf_counter()
        next_sample = None  # from the first turn's time: a service's own trace has Unix times
        for turn in turns:
            if next_sample is None:
                next_sample = turn.time_s
            while next_sample <= turn.time_s:
                self.events_until(next_sample)
                self.sample(next_sample)
                next_sample += self.config.sample_every_s
            self.events_until(turn.time_s)
            self.turn(turn)
        self.events_until(self.now)
        report = self.report
        for stats in self.manager.stats():
            report.tier_bytes[stats["name"]] = stats["usage_bytes"]
            report.demotions += stats["demotions"]
            report.evictions += stats["evictions"]
        report.compress_backlog_end = self.compactor.backlog()
        report.policy = self.value_policy.report() if self.value_policy else {}
        report.seconds = time.perf_counter() - started
        return report

    def sample(self, when: float) -> None:
        self.report.tier_bytes_over_time.append((when, {tier.name: tier.usage() for tier in self.manager.tiers}))

    def events_until(self, now: float) -> None:
        while self.events and self.events[0][0] <= now:
            when, _, event, conversation = heapq.heappop(self.events)
            self.now = when
            if event == "offload":
                if self.offload_at.get(conversation) == when:  # not pushed back by a later turn
                    self.offload(conversation)
            else:
                self.compactor.event(event, conversation)
        self.now = now

    def offload(self, conversation: str) -> None:
        del self.offload_at[conversation]
        self.compressed.discard(conversation)
        if self.value_policy:
            self.value_policy.stored_form(conversation, False)
        exact = self.profile.stored_bytes(self.tokens[conversation], False)
        if self.manager.put(conversation, SizeOnly(exact)) is not None:
            self.compactor.stored(conversation)

    def turn(self, turn: TraceTurn) -> None:
        conversation, report, profile = turn.conversation, self.report, self.profile
        report.turns += 1
        history = self.tokens.get(conversation, 0)
        self.compactor.cancel(conversation)
        if self.value_policy and history:
            self.value_policy.turn_started(conversation)
        if history:
            if conversation in self.offload_at:
                source, restore_ms = ACTIVE, 0.0
            else:
                source = _stored_source(self.manager, conversation)
                compressed = conversation in self.compressed
                if source == RECOMPUTE:
                    restore_ms = profile.recompute_ms(history)
                    report.recompute_ms += restore_ms
                else:
                    restore_ms = profile.restore_ms(source, history, compressed)
                    report.compressed_restores += compressed
            report.resumed[source] += 1
            report.history_tokens[source] += history
            report.first_token_ms.append(restore_ms + profile.extend_ms(history, turn.prompt_tokens))
        if self.config.record_turns:
            report.turn_sources.append(source if history else "first")
        self.tokens[conversation] = history + turn.prompt_tokens + turn.reply_tokens
        self.turn_counts[conversation] += 1
        idle_since = turn.time_s + turn.duration_s  # the reply's end (0 s in a synthetic trace)
        if self.value_policy:
            self.value_policy.went_idle(conversation, turn.tenant, self.turn_counts[conversation],
                                        self.tokens[conversation], now=idle_since)
        self.offload_at[conversation] = idle_since + self.config.idle_offload_s
        self.at(self.offload_at[conversation], "offload", conversation)


class _Compactor:
    """The compression workers and their queue, as configured."""

    def __init__(self, simulation: _Simulation):
        self.sim = simulation
        self.mode = simulation.config.compression
        self.free_workers = simulation.profile.compress_workers
        self.running: dict[str, tuple[float, float]] = {}  # conversation -> (started, cpu ms)
        self.pending: dict[str, float] = {}  # scheduled: stored exact blob -> when stored, oldest first
        self.due: deque[str] = deque()  # scheduled: those of `pending` whose time came, in that order
        self.is_due: set[str] = set()
        self.queue: list[tuple[float, int, str]] = []  # value: (-priority, number, conversation), a heap
        self.queued: dict[str, int] = {}  # value: conversation -> its live queue entry's number
        self.put_off: set[str] = set()  # value: asked again later (their user likely back soon)
        self.was_full = False  # value: the fastest tier was FULL_FRACTION full at the last ask

    def backlog(self) -> int:
        return len(self.pending) + len(self.queued)

    def stored(self, conversation: str) -> None:
        sim = self.sim
        if self.mode == "scheduled":
            self.pending[conversation] = sim.now
            sim.at(sim.now + sim.config.compress_after_s, "due", conversation)
        elif self.mode == "value":
            self.ask(conversation)
        sim.report.compress_backlog_max = max(sim.report.compress_backlog_max, self.backlog())
        self.start_jobs()

    def ask(self, conversation: str) -> None:
        """As the service's compactor asks (sessions/offload.py _due_by_policy), pressed where the blob is in a
        fastest tier FULL_FRACTION full. The service asks again every sweep; here a blob put off is asked
        again at its retry time, or as soon as the fastest tier fills."""
        sim, fastest = self.sim, self.sim.fastest
        is_full = fastest.usage() >= FULL_FRACTION * fastest.capacity()
        if is_full and not self.was_full:  # the tier just filled: what was put off is asked again, pressed
            self.was_full = True
            for put_off in [c for c in self.put_off if c != conversation]:
                self.put_off.discard(put_off)
                if self._is_stored_exact(put_off) and put_off not in self.running:
                    self.ask(put_off)
        self.was_full = is_full
        pressed = is_full and sim.manager.locate(conversation) == fastest.name
        decision = sim.value_policy.compress_decision(conversation, pressed=pressed)
        self.queued.pop(conversation, None)
        self.put_off.discard(conversation)
        if decision.priority is not None:
            number = next(sim.numbers)
            self.queued[conversation] = number
            heapq.heappush(self.queue, (-decision.priority, number, conversation))
        elif decision.retry_at is not None:
            self.put_off.add(conversation)
            sim.at(decision.retry_at, "ask", conversation)

    def cancel(self, conversation: str) -> None:
        """A turn for the conversation: its queued or running compression is off."""
        self.pending.pop(conversation, None)
        self.is_due.discard(conversation)
        self.queued.pop(conversation, None)
        self.put_off.discard(conversation)
        job = self.running.pop(conversation, None)
        if job is not None:
            spent_s = self.sim.now - job[0]
            self.sim.report.compress_cancelled += 1
            self.sim.report.compress_cpu_s += spent_s
            self.sim.report.compress_wasted_cpu_s += spent_s
            self.free_workers += 1
            self.start_jobs()

    def event(self, event: str, conversation: str) -> None:
        if event == "due":
            self.make_due([conversation])
        elif event == "ask":
            if self._is_stored_exact(conversation) and conversation not in self.running:
                self.ask(conversation)
        elif event == "done":
            self.done(conversation)
        self.start_jobs()

    def _is_stored_exact(self, conversation: str) -> bool:
        sim = self.sim
        return (conversation not in sim.offload_at and conversation not in sim.compressed
                and sim.manager.locate(conversation) is not None)

    def make_due(self, conversations) -> None:
        for conversation in conversations:
            if conversation in self.pending and conversation not in self.is_due:
                self.is_due.add(conversation)
                self.due.append(conversation)

    def next_job(self) -> str | None:
        if self.mode == "scheduled":
            fastest = self.sim.fastest
            if len(self.is_due) < len(self.pending) and fastest.usage() >= FULL_FRACTION * fastest.capacity():
                # Compactor.due: every stored exact blob is due, oldest first (a snapshot: they stay due). Since
                # the last such moment only blobs stored after it (at the end of `pending`) are not due yet.
                newer = list(itertools.takewhile(lambda c: c not in self.is_due, reversed(self.pending)))
                self.make_due(reversed(newer))
            while self.due:
                conversation = self.due.popleft()
                if conversation in self.is_due:
                    self.is_due.discard(conversation)
                    return conversation
        elif self.mode == "value":
            while self.queue:
                _, number, conversation = heapq.heappop(self.queue)
                if self.queued.get(conversation) == number:
                    del self.queued[conversation]
                    return conversation
        return None

    def start_jobs(self) -> None:
        sim = self.sim
        while self.free_workers > 0:
            conversation = self.next_job()
            if conversation is None:
                return
            self.pending.pop(conversation, None)
            self.is_due.discard(conversation)
            if not self._is_stored_exact(conversation):
                continue
            cpu_ms = sim.profile.compress_cpu_ms(sim.tokens[conversation])
            self.free_workers -= 1
            self.running[conversation] = (sim.now, cpu_ms)
            if sim.value_policy:
                sim.value_policy.compressing(conversation)
            sim.at(sim.now + cpu_ms / 1e3, "done", conversation)

    def done(self, conversation: str) -> None:
        job = self.running.get(conversation)
        sim = self.sim
        if job is None or sim.now < job[0] + job[1] / 1e3:  # cancelled (and maybe started again) meanwhile
            return
        del self.running[conversation]
        self.free_workers += 1
        sim.report.compress_cpu_s += job[1] / 1e3
        if not self._is_stored_exact(conversation):  # evicted while it ran
            sim.report.compress_wasted_cpu_s += job[1] / 1e3
            return
        if sim.value_policy:
            sim.value_policy.stored_form(conversation, True)
        if sim.manager.put(conversation, SizeOnly(sim.profile.stored_bytes(sim.tokens[conversation], True))):
            sim.compressed.add(conversation)
            sim.report.compressed += 1


def _stored_source(manager: TierManager, conversation: str) -> str:
    """Where a resumed conversation's KV comes from, read as the service reads it (which refreshes its
    recency); recompute where no tier holds it."""
    with manager.read(conversation) as (tier, blob):
        return RECOMPUTE if blob is None else tier
