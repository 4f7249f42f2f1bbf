"""What the admin dashboard charts (issue 16): a bounded ring of samples of the service's stats, one every
`interval_s` for `window_s` (an hour at one per 5 s: 720 samples), kept in memory only.

Each sample holds what happened since the one before (TTFT p50/p95 by restore source, restores per second
by source, the share of turns that did not recompute) and what the service holds at that moment (bytes per
tier, the compression ratio achieved so far, the model thread's queue). Turns are fed by the service as
they end (`record_turn`); the rest is read from `SessionService.stats()`, the one stats source."""

from __future__ import annotations

import time
from collections import deque


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


class StatsHistory:
    def __init__(self, interval_s: float = 5.0, window_s: float = 3600.0):
        self.interval_s = interval_s
        self.window_s = window_s
        self.samples: deque[dict] = deque(maxlen=max(1, int(window_s / interval_s)))
        self._ttfts: dict[str, list[float]] = {}  # restore source -> TTFTs (ms) since the last sample
        self._last_time: float | None = None

    def record_turn(self, source: str, ttft_ms: float) -> None:
        self._ttfts.setdefault(source, []).append(ttft_ms)

    def sample(self, stats: dict, now: float | None = None) -> dict:
        now = time.time() if now is None else now
        elapsed = self.interval_s if self._last_time is None else max(1e-6, now - self._last_time)
        ttfts, self._ttfts, self._last_time = self._ttfts, {}, now
        turns = sum(len(values) for values in ttfts.values())
        sources = [tier["name"] for tier in stats["tiers"]] + ["recompute"]
        compression = stats["compression"]
        thread = stats["model_thread"]
        point = {
            "t": round(now, 3),
            "ttft_ms": {source: [round(_percentile(values, 50), 3), round(_percentile(values, 95), 3)]
                        for source, values in ttfts.items()},
            "restores_per_s": {source: round(len(ttfts.get(source, ())) / elapsed, 4) for source in sources},
            "hit_rate": None if not turns else round(1 - len(ttfts.get("recompute", ())) / turns, 4),
            "tier_bytes": {tier["name"]: tier["usage_bytes"] for tier in stats["tiers"]},
            "compression_ratio": round(compression["raw_bytes"] / compression["stored_bytes"], 4)
            if compression.get("stored_bytes") else 1.0,
            "queue_depth": thread["live_queued"] + thread["background_queued"],
        }
        self.samples.append(point)
        return point

    def report(self) -> dict:
        return {"interval_s": self.interval_s, "window_s": self.window_s, "samples": list(self.samples)}
