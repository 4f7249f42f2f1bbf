"""How likely an idle conversation's user is to come back, learned online from the service's own traffic.

The return gap (a conversation's idle time before its next turn) is modelled by a hazard that is constant
within each of GAP_EDGES_S's log-spaced bins: in a bin, hazard = returns seen in it / idle time spent in it
(the maximum-likelihood estimate with right censoring: a conversation still idle, or one that never comes
back, adds idle time and no return, so conversations that ended pull the later bins' hazard down as they
should). Estimates are kept per stratum (tenant, turns so far) and pooled upwards (tenant, then all
traffic); each level's hazard is shrunk towards its parent's by PRIOR_EXPOSURE_S of pseudo idle time, and
the top's towards a heavy-tailed prior, 1 / (idle + PRIOR_OFFSET_S): the decreasing hazard of a Pareto
tail, which alone orders conversations as LRU does. So a fresh service behaves as LRU and departs from it
only as far as its traffic shows.

Every event is O(bins); the idle time of conversations still away is summed from per-minute counts of
their idle starts, refreshed at most every REFRESH_S of the model's clock."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import numpy as np

GAP_EDGES_S = (0.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1_920.0, 3_840.0, 7_680.0, 15_360.0,
               30_720.0, 61_440.0, 122_880.0, 245_760.0)  # bin starts; the last bin is open-ended
TURN_BUCKETS = (1, 2, 4, 8)  # turns so far: 1, 2, 3-4, 5-8, more
PRIOR_OFFSET_S = 60.0
PRIOR_EXPOSURE_S = 4 * 3_600.0  # a level's estimate counts as much as its parent's after this much idle time
SLOT_S = 60.0  # idle starts are counted per minute
REFRESH_S = 60.0

_STARTS = np.array(GAP_EDGES_S)
_WIDTH_LIST = [b - a for a, b in zip(GAP_EDGES_S, GAP_EDGES_S[1:])] + [math.inf]
_WIDTHS = np.array(_WIDTH_LIST)


def turn_bucket(turns: int) -> int:
    return bisect.bisect_left(TURN_BUCKETS, turns)


def gap_bin(idle_s: float) -> int:
    return max(0, bisect.bisect_right(GAP_EDGES_S, idle_s) - 1)


@dataclass(slots=True)
class _Counts:
    """One level's evidence: returns and closed idle time per bin, and the idle starts still open."""

    returns: list[float] = field(default_factory=lambda: [0.0] * len(GAP_EDGES_S))
    closed: list[float] = field(default_factory=lambda: [0.0] * len(GAP_EDGES_S))  # idle time of ended periods
    open_starts: dict[int, int] = field(default_factory=dict)  # minute slot -> idle periods started in it
    # Open periods older than the last bin's start are kept as two sums, not by minute, so the slots stay
    # bounded however long the service runs: how many, and the sum of their starts.
    folded_through: int = -1  # the newest minute slot folded
    old_count: int = 0
    old_start_sum: float = 0.0
    hazard: np.ndarray | None = None  # per bin, as of the last refresh
    cumulative: list[float] | None = None  # the hazard integrated up to each bin's start
    rates: list[float] | None = None  # `hazard` as floats (faster to index one by one)

    def open(self, started: float, count: int) -> None:
        slot = int(started // SLOT_S)
        if slot <= self.folded_through:
            self.old_count += count
            self.old_start_sum += count * (slot + 0.5) * SLOT_S
            return
        left = self.open_starts.get(slot, 0) + count
        if left:
            self.open_starts[slot] = left
        else:
            self.open_starts.pop(slot, None)

    def close(self, started: float, gap_s: float, returned: bool) -> None:
        self.open(started, -1)
        closed, last = self.closed, gap_bin(gap_s)
        for j in range(last):
            closed[j] += _WIDTH_LIST[j]
        closed[last] += gap_s - GAP_EDGES_S[last]
        if returned:
            self.returns[last] += 1

    def fold(self, now: float) -> None:
        """Sums up the open periods that have passed the last bin's start."""
        through = int((now - GAP_EDGES_S[-1]) // SLOT_S) - 1
        if through <= self.folded_through:
            return
        for slot in [slot for slot in self.open_starts if slot <= through]:
            count = self.open_starts.pop(slot)
            self.old_count += count
            self.old_start_sum += count * (slot + 0.5) * SLOT_S
        self.folded_through = through

    def open_exposure(self, now: float) -> np.ndarray:
        self.fold(now)
        old = np.array(_WIDTH_LIST[:-1] + [0.0]) * self.old_count
        old[-1] = max(0.0, self.old_count * (now - GAP_EDGES_S[-1]) - self.old_start_sum)
        if not self.open_starts:
            return old
        slots = np.fromiter(self.open_starts.keys(), dtype=float)
        counts = np.fromiter(self.open_starts.values(), dtype=float)
        ages = np.maximum(now - (slots + 0.5) * SLOT_S, 0.0)
        in_bins = np.clip(ages[:, None] - _STARTS[None, :], 0.0, _WIDTHS[None, :])
        return counts @ in_bins + old

    def refresh(self, now: float, parent: np.ndarray) -> None:
        exposure = np.array(self.closed) + self.open_exposure(now)
        self.hazard = (np.array(self.returns) + PRIOR_EXPOSURE_S * parent) / (exposure + PRIOR_EXPOSURE_S)
        self.rates = self.hazard.tolist()
        self.cumulative = _integrated(self.rates)


def _integrated(rates: list[float]) -> list[float]:
    total, cumulative = 0.0, []
    for rate, width in zip(rates, _WIDTHS):
        cumulative.append(total)
        total += rate * width
    return cumulative


def _cumulative_at(rates: list[float], cumulative: list[float], idle_s: float) -> float:
    """The hazard integrated from 0 to idle_s."""
    j = gap_bin(idle_s)
    return cumulative[j] + rates[j] * (idle_s - GAP_EDGES_S[j])


def prior_hazard() -> np.ndarray:
    """1 / (idle + PRIOR_OFFSET_S) averaged over each bin (the last: at its start)."""
    hazards = []
    for start, width in zip(GAP_EDGES_S, _WIDTHS):
        if math.isinf(width):
            hazards.append(1.0 / (start + PRIOR_OFFSET_S))
        else:
            hazards.append(math.log((start + width + PRIOR_OFFSET_S) / (start + PRIOR_OFFSET_S)) / width)
    return np.array(hazards)


class ReturnGapModel:
    """Hazard of return per (tenant, turns so far), from the idle periods it is told of."""

    def __init__(self):
        self._levels: dict[tuple, _Counts] = {}
        self._prior = prior_hazard()
        self._prior_rates = self._prior.tolist()
        self._prior_cumulative = _integrated(self._prior_rates)
        self._refreshed_at = -math.inf

    @staticmethod
    def _path(tenant: str, turns: int) -> tuple[tuple, ...]:
        """The levels an idle period counts in, top first."""
        return (), (tenant,), (tenant, turn_bucket(turns))

    def _counts(self, level: tuple) -> _Counts:
        counts = self._levels.get(level)
        if counts is None:
            counts = self._levels[level] = _Counts()
            self._refreshed_at = -math.inf  # its hazard is computed at the next query
        return counts

    def went_idle(self, tenant: str, turns: int, when: float) -> None:
        for level in self._path(tenant, turns):
            self._counts(level).open(when, 1)

    def came_back(self, tenant: str, turns: int, idle_since: float, now: float) -> None:
        self._close(tenant, turns, idle_since, now, returned=True)

    def gone(self, tenant: str, turns: int, idle_since: float, now: float) -> None:
        """The conversation was deleted or expired while idle: its idle time so far counts, no return."""
        self._close(tenant, turns, idle_since, now, returned=False)

    def _close(self, tenant: str, turns: int, idle_since: float, now: float, returned: bool) -> None:
        for level in self._path(tenant, turns):
            self._counts(level).close(idle_since, now - idle_since, returned)

    def refresh(self, now: float) -> None:
        for level in sorted(self._levels, key=len):  # parents first
            parent = self._prior if not level else self._levels[level[:-1]].hazard
            self._levels[level].refresh(now, parent)
        self._refreshed_at = now

    def _estimate(self, tenant: str, turns: int, now: float) -> tuple[list[float], list[float]]:
        """(hazard per bin, its integral to each bin's start) of the most specific level seen."""
        if now - self._refreshed_at >= REFRESH_S:
            self.refresh(now)
        levels = self._levels
        for level in ((tenant, turn_bucket(turns)), (tenant,), ()):
            counts = levels.get(level)
            if counts is not None and counts.rates is not None:
                return counts.rates, counts.cumulative
        return self._prior_rates, self._prior_cumulative

    def hazards(self, tenant: str, turns: int, now: float) -> list[float]:
        """Per bin, returns per second of idle time."""
        return self._estimate(tenant, turns, now)[0]

    def return_probability(self, tenant: str, turns: int, idle_s: float, within_s: float, now: float) -> float:
        """P(the user comes back within `within_s` | away `idle_s` so far)."""
        rates, cumulative = self._estimate(tenant, turns, now)
        integral = _cumulative_at(rates, cumulative, idle_s + within_s) - _cumulative_at(rates, cumulative, idle_s)
        return 1.0 - math.exp(-integral)

    def slots_held(self) -> int:
        """Minute slots of open idle periods kept, over every level (bounded by the last bin's start)."""
        return sum(len(counts.open_starts) for counts in self._levels.values())

    def returns_by_gap(self) -> list[dict]:
        """Every return seen, by gap bin (all tenants)."""
        counts = self._levels.get(())
        returns = counts.returns if counts is not None else [0.0] * len(GAP_EDGES_S)
        return [{"from_s": start, "returns": int(n)} for start, n in zip(GAP_EDGES_S, returns)]

    def table(self, now: float) -> dict[str, list[float]]:
        """Every level's hazard per bin (for the dashboard): 'all', 'tenant', 'tenant/bucket'."""
        self.refresh(now)
        return {"/".join(map(str, level)) or "all": counts.hazard.tolist() for level, counts in self._levels.items()}
