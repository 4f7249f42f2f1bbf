"""Restore planning (Krul §6): how much of a stored conversation to recompute while the rest loads.

Plain Python, no torch, so it is unit-tested on synthetic profiles. The plan recomputes the first r
tokens of the history in every layer (one prefill of r tokens) while a loader reads tokens [r, N) of
every layer's stored KV, and picks r to minimise |T_C - T_L| (Krul eq. 1), the time of the two
streams that run side by side. One r for all layers keeps the recompute lengths non-increasing with
depth (Krul eq. 4-5: every recomputed layer has the hidden states it needs) and, for the same number
of recomputed (layer, token) entries, costs the least attention work (a prefix of r tokens in L
layers costs L r^2 attention, whole leading layers N r L). Layers that share a stored pair with an
earlier layer (cross-layer sharing) load nothing of their own: their bytes are in the pair's. The
extremes (everything loaded, everything recomputed) are always candidates, and a split is chosen only
when the profile says it beats the better of them by MIN_SPLIT_GAIN."""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ComputeProfile:
    """Recompute time of a prefix of r tokens through all layers: fixed + linear * r + quadratic * r^2
    milliseconds (weights, per-token MLP work, attention), fitted from measured prefills. Between the
    measured lengths (`samples`) the time is interpolated instead: the fit misses the real curve by up
    to ~15% (chunked prefill, cache effects), which was the largest error in planned restore times.
    Outside them the fit is scaled to meet the nearest sample, so the curve stays continuous and
    increasing (the planner bisects on it)."""

    fixed_ms: float
    linear_ms: float
    quadratic_ms: float
    samples: tuple[tuple[int, float], ...] = ()  # (tokens, ms), ascending tokens, non-decreasing ms

    def _fitted_ms(self, tokens: float) -> float:
        return self.fixed_ms + self.linear_ms * tokens + self.quadratic_ms * tokens * tokens

    @property
    def step_overhead_tokens(self) -> float:
        """A forward's cost that does not grow with its tokens, in tokens' worth of the per-token cost."""
        return self.fixed_ms / self.linear_ms if self.linear_ms > 0 else 0.0

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return _interpolated(self.samples, tokens, self._fitted_ms)

    def chunk_within(self, context: int, budget_ms: float, most: int, least: int = 16) -> int:
        """The most tokens (within [least, most]) one forward may add to a KV of `context` tokens in about
        `budget_ms`: the recompute curve's growth over them plus a forward's fixed cost."""
        low, high = least, most
        if low >= high:
            return high
        while low < high:
            middle = (low + high + 1) // 2
            cost = self.prefill_ms(context + middle) - self.prefill_ms(context) + self.fixed_ms
            if cost <= budget_ms:
                low = middle
            else:
                high = middle - 1
        return low

    @classmethod
    def fit(cls, samples: list[tuple[int, float]]) -> "ComputeProfile":
        """Least squares over (tokens, ms) samples; needs three distinct lengths."""
        if len({tokens for tokens, _ in samples}) < 3:
            raise ValueError("fitting a compute profile needs prefills of at least three lengths")
        rows = [(1.0, float(t), float(t) * t) for t, _ in samples]
        normal = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
        rhs = [sum(r[i] * ms for r, (_, ms) in zip(rows, samples)) for i in range(3)]
        fixed, linear, quadratic = _solve3(normal, rhs)
        return cls(max(0.0, fixed), max(0.0, linear), max(0.0, quadratic), increasing_points(samples))

    @classmethod
    def from_dict(cls, data: dict) -> "ComputeProfile":
        return cls(float(data["fixed_ms"]), float(data["linear_ms"]), float(data["quadratic_ms"]),
                   increasing_points((int(t), float(ms)) for t, ms in data.get("samples", ())))


def increasing_points(samples) -> tuple[tuple[int, float], ...]:
    """Measured (size, ms) points by size, each at least the one before: a noisy smaller measurement
    never makes a larger one look cheaper."""
    points, highest = [], 0.0
    for size, ms in sorted(samples):
        if points and points[-1][0] == size:
            continue
        highest = max(highest, ms)
        points.append((int(size), highest))
    return tuple(points)


def _interpolated(points, size: float, fitted) -> float:
    """Linear between the measured points around `size`; outside them the fitted curve, scaled to meet
    the nearest point (continuous and increasing, so the planner can bisect on it)."""
    if len(points) < 2:
        return fitted(size)
    (first, first_ms), (last, last_ms) = points[0], points[-1]
    if size <= first:
        return fitted(size) * first_ms / max(1e-9, fitted(first))
    if size >= last:
        return fitted(size) * last_ms / max(1e-9, fitted(last))
    upper = bisect.bisect_left(points, (size, float("-inf")))
    (s0, m0), (s1, m1) = points[upper - 1], points[upper]
    return m0 + (m1 - m0) * (size - s0) / (s1 - s0)


@dataclass(frozen=True, slots=True)
class LoadProfile:
    """Reading from one tier: latency plus bytes over bandwidth, interpolated between the measured
    (bytes, ms) points when there are some (copies into a freshly reserved cache are not linear in size)."""

    latency_ms: float
    megabytes_per_s: float
    samples: tuple[tuple[int, float], ...] = ()

    def _line_ms(self, num_bytes: float) -> float:
        return self.latency_ms + num_bytes / (self.megabytes_per_s * 1e6) * 1e3

    def read_ms(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return _interpolated(self.samples, num_bytes, self._line_ms)

    @classmethod
    def from_dict(cls, data: dict) -> "LoadProfile":
        return cls(float(data["latency_ms"]), float(data["megabytes_per_s"]),
                   increasing_points((int(b), float(ms)) for b, ms in data.get("samples", ())))


@dataclass(frozen=True, slots=True)
class StoredLayer:
    """What loading one history token of this layer reads from the blob (0: rebuilt from a shared pair
    whose bytes another layer carries)."""

    bytes_per_token: float


@dataclass(frozen=True, slots=True)
class RestorePlan:
    num_tokens: int
    recompute_tokens: int  # r: the same for every layer (non-increasing with depth, Krul eq. 4-5)
    compute_ms: float  # T_C
    load_ms: float  # T_L

    @property
    def total_ms(self) -> float:
        return max(self.compute_ms, self.load_ms)

    @property
    def load_range(self) -> tuple[int, int]:
        return self.recompute_tokens, self.num_tokens

    def per_layer(self, num_layers: int) -> list[tuple[int, tuple[int, int]]]:
        """Per layer: (tokens recomputed, token range loaded)."""
        return [(self.recompute_tokens, self.load_range)] * num_layers


# A split runs two streams that contend for memory bandwidth and starts a thread, which the profile
# does not model: it must promise at least this much over the better extreme to be chosen. (Measured:
# a noisy probe once made a split of 10 tokens look 0.4% faster than loading; it ran 13% slower.)
MIN_SPLIT_GAIN = 0.05


def plan_restore(num_tokens: int, layers: list[StoredLayer], compute: ComputeProfile, load: LoadProfile,
                 stored_from: int = 0, min_split_gain: float = MIN_SPLIT_GAIN, then_ms: float = 0.0) -> RestorePlan:
    """`stored_from`: the blob holds tokens [stored_from, N) only (a blob that dropped its recompute
    prefix at offload), so at least that prefix is recomputed. `then_ms`: compute the compute stream runs
    after the prefix while loads go on (a GPU restore prefills the new message behind the loaded layers,
    statekeeper/device_restore.py), counted in T_C."""
    if num_tokens <= 0:
        return RestorePlan(num_tokens, 0, 0.0, 0.0)
    bytes_per_token = sum(layer.bytes_per_token for layer in layers)

    def plan(r: int) -> RestorePlan:
        return RestorePlan(num_tokens, r, compute.prefill_ms(r) + then_ms,
                           load.read_ms(bytes_per_token * (num_tokens - r)))

    low, high = stored_from, num_tokens
    # T_C - T_L grows with r: bisect for the crossing, then keep the best of its neighbours and the extremes.
    while high - low > 1:
        middle = (low + high) // 2
        candidate = plan(middle)
        if candidate.compute_ms < candidate.load_ms:
            low = middle
        else:
            high = middle
    extremes = [plan(r) for r in {stored_from, num_tokens}]
    splits = [plan(r) for r in {low, high} - {stored_from, num_tokens}]
    best_extreme = min(extremes, key=lambda p: (p.total_ms, p.recompute_tokens))
    best_split = min(splits, key=lambda p: p.total_ms, default=None)
    if best_split is not None and best_split.total_ms < (1 - min_split_gain) * best_extreme.total_ms:
        return best_split
    return best_extreme


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a 3x3 system."""
    m = [row[:] + [value] for row, value in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            raise ValueError("singular system")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            factor = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= factor * m[col][c]
    x = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        x[r] = (m[r][3] - sum(m[r][c] * x[c] for c in range(r + 1, 3))) / m[r][r]
    return x
