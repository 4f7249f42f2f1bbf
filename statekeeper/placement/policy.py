"""The expected-value placement policy (issue 32): a stored conversation is worth the chance that its user comes
back while it would stay in its tier (ReturnGapModel: by tenant, turns so far and time already away; the
tier's residence time followed from its victims) times what its stored state saves that return against
recomputing the history (CostProfile: per tier and form), per byte it holds. A full tier moves down its least
valuable blob; the last tier drops it. The compactor asks it which exact blobs to compress and in what order:
those likely to be read back, but not within minutes, most bytes saved per CPU second first; blobs whose user
is unlikely to return are left for eviction instead of costing CPU.

Books: per tier and per stratum (tenant, form, pinned, exact copy or not) a heap of blobs by the time their
conversation went idle, oldest first. An exact copy (sessions/exact_copy.py) is valued by its conversation's
chance of a return and at most its compressed blob's saving, spread over its own larger size: it adds only
fidelity, so it never outranks the blob it belongs to and is never pinned. (Strata by turns so far too were measured worse than LRU on a trace whose turns carry no
signal: their noisy estimates picked younger victims. The turns still shape each candidate's value.) Within a
stratum value falls with idle time wherever the chance of a return does (past the first minutes of a heavy
tail), so a victim is the least valuable of the strata's oldest blobs: O(strata + log n) per eviction,
O(log n) per placement. Pinned blobs leave only when nothing else is left; priority multiplies the value.

The service and the simulator drive the same methods: turn_started / went_idle / stored_form / forget
from the conversation's lifecycle, placed / taken / choose_victim from the TierManager."""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from statekeeper.placement.costs import CostProfile, MeasuredCompression
from statekeeper.placement.return_model import ReturnGapModel

# The schedule LRU compresses on (sessions/offload.py's Compactor, and the simulator's copy of its rule): the
# fastest tier counts as out of room above this share of its budget, and then every stored exact blob is due.
FULL_FRACTION = 0.9
# An exact copy's key: its conversation's id and this (sessions/exact_copy.py; ids never end so).
COPY_SUFFIX = ".exact"
SOON_S = 300.0  # a blob whose user is likely (RETURN_SOON) back within this stays exact for now
RETURN_SOON = 0.5
HORIZON_S = 86_400.0  # compressing pays only for returns within this
MIN_RETURN = 0.05  # below this chance of a return within HORIZON_S, compressing is not worth its CPU
CALIBRATION_S = 3_600.0  # predicted vs actual returns within this
# A conversation stored nowhere and away this long is forgotten (its idle time counts as a gap with no return),
# checked once per PRUNE_EVERY_S, so the books stay bounded however long the service runs.
FORGET_AFTER_S = 7 * 86_400.0
PRUNE_EVERY_S = 3_600.0
# A blob is valued by the returns expected while it would stay in its tier: that tier's residence time,
# followed as the moving average of its victims' time away (from RESIDENCE_START_S, kept within bounds).
RESIDENCE_START_S = 3_600.0
RESIDENCE_BOUNDS_S = (60.0, 7 * 86_400.0)
RESIDENCE_WEIGHT = 0.01  # of each new victim in the average


@dataclass(slots=True)
class Held:
    """What the policy knows of a stored conversation."""

    tenant: str
    turns: int
    tokens: int
    idle_since: float
    compressed: bool = False
    compressing: bool = False  # the compactor is compressing it: valued at its compressed size
    pinned: bool = False
    priority: float = 1.0
    expires_at: float | None = None  # its TTL: the stored KV is dropped then
    # The return-gap model holds an idle period of it, open: closed once, by its user's return (a turn started)
    # or by its end without one (deleted, forgotten). A blob adopted at start-up has none; a turn that fails
    # after its return was counted leaves the period closed until the next went_idle opens another.
    period_open: bool = False
    copy_of: str | None = None  # an exact copy's conversation (COPY_SUFFIX keys)


@dataclass(frozen=True, slots=True)
class CompressDecision:
    priority: float | None  # higher first; None: not now
    retry_at: float | None  # when to ask again; None with priority None: never (leave it exact)


class ValuePolicy:
    decides_compression = True  # the compactor asks compress_decision instead of following its schedule
    kind = "value"

    def __init__(self, costs: CostProfile, tier_names: list[str], model: ReturnGapModel | None = None,
                 clock: Callable[[], float] = time.time):
        self.costs = costs
        self.measured = MeasuredCompression(costs)  # costs follows what the service's compressions measure
        self.tier_names = list(tier_names)
        self.model = model or ReturnGapModel()
        self.clock = clock
        self._lock = threading.RLock()
        self._held: dict[str, Held] = {}
        self._where: dict[str, tuple[int, int]] = {}  # key -> (tier, placement number)
        self._heaps: list[dict[tuple, list]] = [{} for _ in tier_names]  # tier -> stratum -> heap
        # Entries in each tier's heaps, placed or stale (moved, placed again, taken): refiled when mostly stale
        self._entries = [0 for _ in tier_names]
        self._placements = itertools.count()
        self._expiries: list[tuple[float, str]] = []  # (expires_at, key), a heap; superseded entries skipped
        self._queued_expiries = 0  # the TTLs the books held when the heap was last rebuilt
        self._timed: set[str] = set()  # the keys whose TTL may still be to come (the rebuild's, not every key's)
        self._pruned_at = -math.inf
        self.residence_s = [RESIDENCE_START_S for _ in tier_names]  # per tier
        self.counters = Counter()  # victims by how they were chosen, calibration sums

    # -- the conversation's lifecycle ------------------------------------------------------------

    def turn_started(self, key: str, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        with self._lock:
            held = self._held.get(key)
            if held is None or not held.period_open:  # a turn that failed and is tried again: counted already
                return
            held.period_open = False
            gap = now - held.idle_since
            self.model.came_back(held.tenant, held.turns, held.idle_since, now)
            self.counters["returns_within_hour"] += gap <= CALIBRATION_S

    def went_idle(self, key: str, tenant: str, turns: int, tokens: int, now: float | None = None,
                  pinned: bool = False, priority: float = 1.0, ttl_s: float | None = None) -> None:
        """A turn ended: the conversation is idle from `now`, with its retention (pinned, priority weight, TTL)."""
        now = self.clock() if now is None else now
        with self._lock:
            self.model.went_idle(tenant, turns, now)
            self.counters["predicted_returns_within_hour"] += self.model.return_probability(
                tenant, turns, 0.0, CALIBRATION_S, now)
            held = self._held[key] = Held(tenant, turns, tokens, now, pinned=pinned, priority=priority,
                                          period_open=True)
            self._expire_after(key, held, ttl_s)

    def expire_at(self, key: str, at: float) -> None:
        """The conversation's TTL runs out at `at` (the policy's clock) instead: a later turn on another replica
        restarted it there."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.expires_at = at
                self._push_expiry(at, key)

    def _expire_after(self, key: str, held: Held, ttl_s: float | None) -> None:
        held.expires_at = None if ttl_s is None else held.idle_since + ttl_s
        if held.expires_at is not None:
            self._push_expiry(held.expires_at, key)
        else:
            self._timed.discard(key)

    def _push_expiry(self, at: float, key: str) -> None:
        """Queues the key's expiry; the queue is rebuilt from the books when past twice their TTLs: an entry a
        later turn superseded, or a deleted conversation's, stayed until its time came, so a day's TTL kept a
        day of turns queued."""
        heapq.heappush(self._expiries, (at, key))
        self._timed.add(key)
        if len(self._expiries) > 2 * self._queued_expiries + 64:
            self._timed = {key for key in self._timed if key in self._held and self._held[key].expires_at is not None}
            self._expiries = [(self._held[key].expires_at, key) for key in self._timed]
            heapq.heapify(self._expiries)
            self._queued_expiries = len(self._expiries)

    def stored_form(self, key: str, compressed: bool) -> None:
        """Says what the next put of `key` holds (before the put: the placement files it by form)."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.compressed, held.compressing = compressed, False

    def compressing(self, key: str) -> None:
        """The compactor started on the key's blob: it is valued at the size it is about to have."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.compressing = True
                self._refile(key)

    def compression_ended(self, key: str) -> None:
        """The compactor is done with the key's blob: compressed (stored_form said so before the put), or left as
        it was (skipped, failed, cancelled), which is then valued at the size it holds again."""
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.compressing:
                held.compressing = False
                self._refile(key)

    def retention(self, key: str, pinned: bool, priority: float, ttl_s: float | None) -> None:
        """The conversation's retention changed: its stored blob is filed again (pinned ones apart)."""
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return
            held.pinned, held.priority = pinned, priority
            self._expire_after(key, held, ttl_s)
            self._refile(key)

    def _refile(self, key: str) -> None:
        """Files a placed blob again under its stratum now (its form or retention changed): a heap's oldest
        entry must be one the stratum's value ranks with the rest."""
        where = self._where.get(key)
        if where is not None:
            self.placed(where[0], key, 0)

    def expired(self, now: float | None = None) -> list[str]:
        """The conversations whose TTL has passed since they went idle (each once; counted as expired)."""
        now = self.clock() if now is None else now
        due = []
        with self._lock:
            while self._expiries and self._expiries[0][0] <= now:
                expires_at, key = heapq.heappop(self._expiries)
                held = self._held.get(key)
                if held is not None and held.expires_at == expires_at:
                    held.expires_at = None
                    self._timed.discard(key)
                    due.append(key)
            self.counters["expired"] += len(due)
            if now - self._pruned_at >= PRUNE_EVERY_S:
                self._prune(now)
        return due

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        # Kept: one whose blob is placed, and one whose TTL is still to come (LRU books no blob): it drops the KV
        gone = [key for key, held in self._held.items() if now - held.idle_since > FORGET_AFTER_S and not held.pinned
                and key not in self._where and held.expires_at is None]
        conversations = 0
        for key in gone:
            held = self._held.pop(key)
            if held.copy_of is None:  # a copy's gap is its conversation's, heard of once
                self._gone(held, now)
                conversations += 1
        self.counters["forgotten"] += conversations

    def forget(self, key: str, now: float | None = None) -> None:
        """The conversation was deleted: its idle time so far counts as a gap with no return."""
        now = self.clock() if now is None else now
        with self._lock:
            held = self._held.pop(key, None)
            self._held.pop(key + COPY_SUFFIX, None)
            self._timed.discard(key)
            # Its blobs leave the tiers after this (the delete reaches the I/O thread later): no longer
            # candidates, since their books are gone
            self._where.pop(key, None)
            self._where.pop(key + COPY_SUFFIX, None)
            if held is not None:
                self._gone(held, now)

    def _gone(self, held: Held, now: float) -> None:
        """Its idle period (if one is open) ends with no return."""
        if held.period_open:
            held.period_open = False
            self.model.gone(held.tenant, held.turns, held.idle_since, now)

    def compressed(self, tokens: int, exact_bytes: int, stored_bytes: int, cpu_ms: float | None) -> None:
        """A blob of `tokens` was compressed from `exact_bytes` to `stored_bytes` in `cpu_ms` (None: not timed):
        the costs it weighs by follow the measured compression ratio and CPU."""
        with self._lock:
            self.measured.add(tokens, exact_bytes, stored_bytes, cpu_ms)
            self.costs = self.measured.profile()

    # -- the tier manager's books ----------------------------------------------------------------

    def placed(self, tier: int, key: str, size: int) -> None:
        with self._lock:
            held = self._copy_of(key) or self._held.get(key)
            if held is None:  # adopted at start-up, or stored before the policy heard of it
                held = self._held[key] = Held("", 1, max(1, size // self.costs.bytes_per_token), self.clock())
            number = next(self._placements)
            self._where[key] = (tier, number)
            stratum = (held.tenant, held.compressed or held.compressing, held.pinned, held.copy_of is not None)
            heapq.heappush(self._heaps[tier].setdefault(stratum, []), (held.idle_since, number, key))
            self._entries[tier] += 1
            if self._entries[tier] > 2 * len(self._where) + 64:
                self._drop_stale(tier)

    def _drop_stale(self, tier: int) -> None:
        """Drops the tier's stale entries: a blob placed again at each offload left one, which only a look at
        the heap's top dropped (never, in a tier that never fills), so the books grew with every offload."""
        entries = 0
        for stratum, heap in list(self._heaps[tier].items()):
            heap[:] = [entry for entry in heap if self._where.get(entry[2]) == (tier, entry[1])]
            heapq.heapify(heap)
            entries += len(heap)
            if not heap:
                del self._heaps[tier][stratum]
        self._entries[tier] = entries

    def taken(self, tier: int, key: str) -> None:
        with self._lock:
            if self._where.get(key, (None,))[0] == tier:
                del self._where[key]

    def _copy_of(self, key: str) -> Held | None:
        """An exact copy's books, from its conversation's where the policy knows it (under the lock): its
        tenant, turns and idle time, its priority, never pinned (a copy only adds fidelity; the blob is what
        the pin keeps)."""
        if not key.endswith(COPY_SUFFIX):
            return None
        conversation = self._held.get(key.removesuffix(COPY_SUFFIX))
        if conversation is None:
            return None
        held = self._held[key] = Held(conversation.tenant, conversation.turns, conversation.tokens,
                                      conversation.idle_since, priority=conversation.priority,
                                      copy_of=key.removesuffix(COPY_SUFFIX))
        return held

    def choose_victim(self, tier: int, entries: OrderedDict[str, int]) -> str:
        now = self.clock()
        with self._lock:
            best, best_value = None, None
            for stratum, heap in list(self._heaps[tier].items()):
                key = self._oldest(tier, heap)
                if key is None:
                    del self._heaps[tier][stratum]
                    continue
                value = self.value(tier, key, entries.get(key, 1), now)
                if best is None or value < best_value:
                    best, best_value = key, value
            if best is None or best not in entries:  # books out of step with the manager's: LRU
                self.counters["lru_fallbacks"] += 1
                return next(iter(entries))
            away = now - self._held[best].idle_since
            low, high = RESIDENCE_BOUNDS_S
            residence = self.residence_s[tier] + RESIDENCE_WEIGHT * (away - self.residence_s[tier])
            self.residence_s[tier] = min(high, max(low, residence))
            return best

    def keep_first(self, tier: int, entries: OrderedDict[str, int]) -> list[str]:
        """The tier's keys by value, the highest first; those it holds no record of (known only since a restart)
        before them, as return_chance counts them sure to return, most recently used first."""
        now = self.clock()
        with self._lock:
            newest_first = list(reversed(entries))
            unknown = [key for key in newest_first if key not in self._held]
            known = [key for key in newest_first if key in self._held]
            return unknown + sorted(known, key=lambda key: self.value(tier, key, entries[key], now), reverse=True)

    def _oldest(self, tier: int, heap: list) -> str | None:
        """The heap's oldest entry still placed where it says (stale ones, moved or re-placed, are dropped)."""
        while heap:
            _, number, key = heap[0]
            if self._where.get(key) == (tier, number):
                return key
            heapq.heappop(heap)
            self._entries[tier] -= 1
        return None

    def value(self, tier: int, key: str, size: int, now: float) -> float:
        """Expected saving per byte over the tier's residence time; pinned blobs above every unpinned one."""
        held = self._held[key]
        returns = self.model.return_probability(held.tenant, held.turns, now - held.idle_since,
                                                self.residence_s[tier], now)
        # A copy saves nothing its compressed blob does not (it adds fidelity when the user returns): it is
        # worth that blob's saving at most, spread over its own, larger size.
        compressed = held.compressed or held.compressing or held.copy_of is not None
        saved = self.costs.saved_ms(self.tier_names[tier], held.tokens, compressed)
        if held.compressing:  # about to shrink: what it will hold, not what it holds now
            size = self.costs.stored_bytes(held.tokens, True)
        worth = returns * saved * held.priority / max(1, size)
        return worth + (1e30 if held.pinned else 0.0)

    def return_chance(self, key: str, within_s: float, now: float | None = None) -> float:
        """The chance that the conversation's user comes back within `within_s` from `now`, as far as the policy
        knows it (1 for one it holds no record of: in its first turn, or known only since a restart)."""
        now = self.clock() if now is None else now
        with self._lock:
            held = self._held.get(key)
            if held is None:
                return 1.0
            return self.model.return_probability(held.tenant, held.turns, now - held.idle_since, within_s, now)

    # -- the compactor's questions ---------------------------------------------------------------

    def compress_decision(self, key: str, now: float | None = None, pressed: bool = False) -> CompressDecision:
        """Whether to compress the key's exact blob now (its priority), later (when to ask again) or never.
        `pressed`: the fastest tier is FULL_FRACTION full, so a blob kept exact for a likely return soon would
        be moved down exact, eight times larger: it is compressed now all the same."""
        now = self.clock() if now is None else now
        with self._lock:
            held = self._held.get(key)
            if held is None or held.compressed:
                return CompressDecision(None, None)
            idle, model = now - held.idle_since, self.model
            if not pressed and model.return_probability(held.tenant, held.turns, idle, SOON_S, now) > RETURN_SOON:
                return CompressDecision(None, now + SOON_S)
            returns = model.return_probability(held.tenant, held.turns, idle, HORIZON_S, now)
            if returns < MIN_RETURN and not held.pinned:
                return CompressDecision(None, None)
            costs = self.costs
            saved_bytes = costs.stored_bytes(held.tokens, False) - costs.stored_bytes(held.tokens, True)
            cpu_ms = max(1e-3, costs.compress_cpu_ms(held.tokens))
            return CompressDecision(returns * held.priority * saved_bytes / cpu_ms, None)

    def report(self) -> dict:
        """Its counters, how many conversations it knows, each tier's residence time and the return gaps
        seen (the return-gap histogram: returns per gap bin, from the bin's start in seconds)."""
        with self._lock:
            return {"policy": self.kind, "held": sum(held.copy_of is None for held in self._held.values()),
                    "predicted_returns_within_hour": round(self.counters["predicted_returns_within_hour"], 3),
                    "returns_within_hour": self.counters["returns_within_hour"],
                    "lru_fallbacks": self.counters["lru_fallbacks"], "expired": self.counters["expired"],
                    "forgotten": self.counters["forgotten"],
                    "book_entries": sum(len(heap) for heaps in self._heaps for heap in heaps.values()),
                    "expiry_entries": len(self._expiries),
                    "residence_s": dict(zip(self.tier_names, (round(r, 1) for r in self.residence_s))),
                    "return_gaps": self.model.returns_by_gap(), "compression": self.measured.report()}


class LruPlacement(ValuePolicy):
    """LRU eviction and compression on the compactor's fixed schedule (COMPRESS_AFTER_SECONDS). It hears of
    the conversations' lifecycle as the value policy does, so its return-gap model and calibration show on
    the dashboard either way, but decides nothing by them."""

    decides_compression = False
    kind = "lru"

    def placed(self, tier: int, key: str, size: int) -> None:
        pass

    def taken(self, tier: int, key: str) -> None:
        pass

    def choose_victim(self, tier: int, entries: OrderedDict[str, int]) -> str:
        """The least recently used blob that is not pinned (all pinned: the least recently used)."""
        with self._lock:
            held = self._held
            return next((key for key in entries if key not in held or not held[key].pinned), next(iter(entries)))

    def keep_first(self, tier: int, entries: OrderedDict[str, int]) -> list[str]:
        """The pinned blobs, then the others; each most recently used first."""
        with self._lock:
            held = self._held
            return sorted(reversed(entries), key=lambda key: not (key in held and held[key].pinned))


PLACEMENT_POLICIES = ("lru", "value")


def build_policy(kind: str, costs: CostProfile, tier_names: list[str]) -> LruPlacement | ValuePolicy:
    """PLACEMENT_POLICY's policy; raises ValueError for another name."""
    if kind == "lru":
        return LruPlacement(costs, tier_names)
    if kind == "value":
        return ValuePolicy(costs, tier_names)
    raise ValueError(f"placement_policy must be one of {', '.join(PLACEMENT_POLICIES)}, not {kind!r}")
