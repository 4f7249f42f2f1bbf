"""The one percentile every benchmark reports, so that a p95 in one table is the same statistic as a p95 in
another (history_backends.py and lock_hygiene.py took the nearest rank, the rest interpolated)."""

from __future__ import annotations


def percentile(values, q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
