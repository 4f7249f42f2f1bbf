"""Prometheus metrics (issue 16): what GET /metrics exports.

Two kinds. Events are counted where they happen: a turn's end (its restore source, TTFT, restore time,
cached and prefilled tokens, its waits) and an HTTP response (api/http_metrics.py). State is read when
scraped, from the service's `stats()`, the same dict the admin API and the dashboard show: tier usage,
budgets and counters, sessions, the model thread, compression. Only counters, never a rate or a hit
ratio: a ratio overwritten now and then says nothing about the time between scrapes, while counters let
the dashboard compute any rate over any window (`rate(a) / rate(b)`), as vLLM's prefix-cache queries and
hits do.

Each Metrics owns its registry, never prometheus-client's global one: tests build many services in one
process, and each must export only its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector



class FinishedTurn(Protocol):
    """What a turn's end reports (statekeeper/sessions/turns.py TurnResult): the metrics read only this."""

    restore_source: str
    ttft_ms: float
    restore_ms: float
    lock_wait_ms: float
    first_queue_ms: float | None
    cached_tokens: int
    prompt_tokens: int
    completion_tokens: int

# The classic text format, which every Prometheus reads: what generate_latest writes for names without dots
# or other UTF-8 (prometheus-client 0.22+ labels it version 1.0.0, which older servers do not know).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# A hot turn on the tiny test model takes milliseconds, a long recompute on a CPU tens of seconds.
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Waits are mostly zero; the interesting ones are a few model steps or a tier write long.
WAIT_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

TIER_GAUGES = {
    "usage_bytes": "Bytes the tier holds",
    "budget_bytes": "Bytes the tier may hold",
    "blobs": "Stored KV states in the tier",
    "available": "1 while the tier can be reached, else 0",
}
TIER_COUNTERS = {
    "hits": "Reads that found their blob in the tier",
    "misses": "Reads of a blob the tier was known to hold but no longer had",
    "promotions": "Blobs moved out of the tier into a faster one",
    "demotions": "Blobs moved out of the tier into a slower one, to make room",
    "evictions": "Blobs dropped from the tier for room with no slower tier to take them (they recompute)",
    "errors": "Tier calls that failed, and blobs read from the tier that failed validation",
}
SESSION_GAUGES = {
    "sessions_in_memory": "Conversation objects held in memory (active and idle)",
    "active_sessions": "Conversations whose KV is in the worker",
    "active_kv_bytes": "Bytes of KV in the worker",
    "active_kv_budget_bytes": "Bytes of KV the worker may hold before the least recently used is offloaded",
    "turns_in_progress": "Turns and scorings under way",
    "missing_blobs_at_start": "Indexed KV blobs that were gone when the service started",
}
PRIORITIES = ("live", "background")  # the model thread's: turns and restores before compression scoring
COMPRESSION_OUTCOMES = ("compressed", "cancelled", "failed", "skipped", "declined")


class Metrics:
    """The registry behind GET /metrics: event counters recorded by `record_turn` and
    `record_request`, and `stats()` (SessionService.stats) read at every scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        registry = self.registry
        self.turns = Counter("statekeeper_turns", "Finished turns by where the conversation's KV came from: "
                             "active (in memory), a tier's name (restored from it), recompute (from the history)",
                             ["source"], registry=registry)
        self.ttft = Histogram("statekeeper_ttft_seconds", "Time to a turn's first token, by restore source",
                              ["source"], buckets=SECONDS, registry=registry)
        self.restore = Histogram("statekeeper_restore_seconds", "Time to restore a conversation's KV before its "
                                 "turn, by restore source (turns with active KV restore nothing and are left out)",
                                 ["source"], buckets=SECONDS, registry=registry)
        # Together with the restore these split the TTFT into waiting and computing.
        self.lock_wait = Histogram("statekeeper_turn_lock_wait_seconds", "Time a turn waited for its "
                                   "conversation, held by another request (an offload, a compaction)",
                                   buckets=WAIT_SECONDS, registry=registry)
        self.first_queue = Histogram("statekeeper_turn_first_queue_seconds", "Time a turn's prefill waited in "
                                     "line for the model thread", buckets=WAIT_SECONDS, registry=registry)
        self.prompt_tokens = Counter("statekeeper_prompt_tokens", "Prompt tokens of finished turns: cached (their "
                                     "KV was kept or restored) or prefilled (computed by the turn)", ["kind"],
                                     registry=registry)
        self.completion_tokens = Counter("statekeeper_completion_tokens", "Tokens generated by finished turns",
                                         registry=registry)
        self.http_requests = Counter("statekeeper_http_requests", "HTTP responses by route template, method "
                                     "and status", ["route", "method", "status"], registry=registry)
        for source in ("active", "recompute"):  # the series a dashboard's rates divide by exist from the start
            self.turns.labels(source)
        for kind in ("cached", "prefilled"):
            self.prompt_tokens.labels(kind)
        registry.register(_StateCollector(stats))

    def record_turn(self, result: FinishedTurn) -> None:
        source = result.restore_source
        self.turns.labels(source).inc()
        self.ttft.labels(source).observe(result.ttft_ms / 1000)
        if source != "active":
            self.restore.labels(source).observe(result.restore_ms / 1000)
        self.lock_wait.observe(result.lock_wait_ms / 1000)
        if result.first_queue_ms is not None:  # None: the restore ran the prefill (a compressed blob)
            self.first_queue.observe(result.first_queue_ms / 1000)
        self.prompt_tokens.labels("cached").inc(result.cached_tokens)
        self.prompt_tokens.labels("prefilled").inc(result.prompt_tokens - result.cached_tokens)
        self.completion_tokens.inc(result.completion_tokens)

    def record_request(self, route: str, method: str, status: int) -> None:
        """`route` is the path template (/v1/sessions/{session_id}): an id in a label would put a
        conversation's key in every scrape and make one series per conversation."""
        self.http_requests.labels(route, method, str(status)).inc()

    def exposition(self) -> bytes:
        """Prometheus text format. Call it on the event loop's thread, as `stats()` asks."""
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """What the service holds now, read from its stats at each scrape."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from _tier_metrics(stats["tiers"])
        for key, text in SESSION_GAUGES.items():
            yield GaugeMetricFamily(f"statekeeper_{key}", text, value=stats[key])
        yield from _model_thread_metrics(stats["model_thread"])
        if stats["long_prefill_lane"] is not None:
            yield from _long_lane_metrics(stats["long_prefill_lane"])
        yield from _compression_metrics(stats["compression"])
        yield from _placement_metrics(stats["placement"])


def _tier_metrics(tiers: list[dict]) -> Iterator[Metric]:
    for key, text in TIER_GAUGES.items():
        gauge = GaugeMetricFamily(f"statekeeper_tier_{key}", text, labels=["tier"])
        for tier in tiers:
            gauge.add_metric([tier["name"]], float(tier[key]))
        yield gauge
    for key, text in TIER_COUNTERS.items():
        counter = CounterMetricFamily(f"statekeeper_tier_{key}", text, labels=["tier"])
        for tier in tiers:
            counter.add_metric([tier["name"]], tier[key])
        yield counter


def _model_thread_metrics(thread: dict) -> Iterator[Metric]:
    families = (
        (CounterMetricFamily, "statekeeper_model_thread_busy_seconds", "Seconds the model thread ran jobs",
         "{}_seconds"),
        (CounterMetricFamily, "statekeeper_model_thread_jobs", "Jobs the model thread finished", "{}_jobs"),
        (CounterMetricFamily, "statekeeper_model_thread_wait_seconds", "Seconds the model thread's jobs waited "
         "in line before they started (divided by the jobs: the mean wait)", "{}_wait_seconds"),
        (GaugeMetricFamily, "statekeeper_model_thread_queue_depth", "Jobs waiting in line for the model thread",
         "{}_queued"),
    )
    for family, name, text, key in families:
        metric = family(name, text, labels=["priority"])
        for priority in PRIORITIES:
            metric.add_metric([priority], thread[key.format(priority)])
        yield metric
    yield CounterMetricFamily("statekeeper_batch_steps", "Batched forwards the model thread ran",
                              value=thread["batch_steps"])
    yield CounterMetricFamily("statekeeper_batch_rows", "Tokens the batched forwards carried",
                              value=thread["batch_rows"])
    yield CounterMetricFamily("statekeeper_batch_sessions", "Conversations the batched forwards carried (divided "
                              "by the steps: the mean batch)", value=thread["batch_sessions"])


def _long_lane_metrics(lane: dict) -> Iterator[Metric]:
    """The second model thread that long prompts run on (scheduler/lanes.py), where there is one."""
    yield CounterMetricFamily("statekeeper_long_lane_busy_seconds", "Seconds the long-prompt model thread ran "
                              "jobs", value=lane["live_seconds"])
    yield CounterMetricFamily("statekeeper_long_lane_jobs", "Jobs the long-prompt model thread finished",
                              value=lane["live_jobs"])
    yield CounterMetricFamily("statekeeper_long_lane_wait_seconds", "Seconds the long-prompt model thread's jobs "
                              "waited in line before they started", value=lane["live_wait_seconds"])
    yield GaugeMetricFamily("statekeeper_long_lane_queue_depth", "Jobs waiting in line for the long-prompt model "
                            "thread", value=lane["live_queued"])


def _compression_metrics(compression: dict) -> Iterator[Metric]:
    outcomes = CounterMetricFamily("statekeeper_compressions", "Stored exact blobs the compactor finished with, "
                                   "by outcome", labels=["outcome"])
    for outcome in COMPRESSION_OUTCOMES:
        outcomes.add_metric([outcome], compression[outcome])
    yield outcomes
    yield GaugeMetricFamily("statekeeper_compression_queued", "Stored exact blobs waiting to be compressed",
                            value=compression["queued"])
    cpu = CounterMetricFamily("statekeeper_compression_cpu_seconds", "CPU seconds spent compressing: in the "
                              "compression process (all of it), or in the service's own (eviction and codec; "
                              "scoring there is the model thread's background time)", labels=["method"])
    cpu.add_metric(["process"], compression["process_cpu_seconds"])
    cpu.add_metric(["in_service"], compression["encode_seconds"])
    yield cpu
    yield CounterMetricFamily("statekeeper_compression_raw_bytes", "Stored bytes of blobs before their "
                              "compression", value=compression["raw_bytes"])
    yield CounterMetricFamily("statekeeper_compression_stored_bytes", "Stored bytes of the same blobs after it "
                              "(raw / stored: the compression ratio)", value=compression["stored_bytes"])
    copies = CounterMetricFamily("statekeeper_exact_copies", "Exact states kept beside compressed blobs "
                                 "(EXACT_COPY_TIER) and compressed restores that took them, by "
                                 "event", labels=["event"])
    for event, count in compression["exact_copies"].items():
        copies.add_metric([event], count)
    yield copies


def _placement_metrics(placement: dict) -> Iterator[Metric]:
    """The placement policy's calibration and the return gaps it learns from (statekeeper/placement/): the
    decisions themselves are the tiers' demotions and evictions and the compressions' outcomes."""
    gaps = CounterMetricFamily("statekeeper_placement_returns", "Users who came back to an idle conversation, by "
                               "how long it had been idle (the gap bin's start, seconds)", labels=["gap_from_s"])
    for gap in placement["return_gaps"]:
        gaps.add_metric([f"{gap['from_s']:g}"], gap["returns"])
    yield gaps
    yield CounterMetricFamily("statekeeper_placement_predicted_returns_within_hour", "The return-gap model's "
                              "chance of a return within an hour, summed over every conversation that went idle",
                              value=placement["predicted_returns_within_hour"])
    yield CounterMetricFamily("statekeeper_placement_returns_within_hour", "Returns that came within an hour of "
                              "the conversation going idle (against the predicted: the model's calibration)",
                              value=placement["returns_within_hour"])
    yield GaugeMetricFamily("statekeeper_placement_conversations", "Conversations the placement policy knows",
                            value=placement["held"])
    yield CounterMetricFamily("statekeeper_placement_expired", "Stored states dropped because their retention "
                              "TTL passed (their conversations recompute)", value=placement["expired"])
    measured = placement["compression"]
    yield GaugeMetricFamily("statekeeper_placement_compression_ratio", "The compression ratio the policy weighs "
                            "by: its prior, then what the service's compressions measured",
                            value=measured["compression_ratio"])
    if measured["compress_prefills"] is not None:
        yield GaugeMetricFamily("statekeeper_placement_compress_prefills", "Compressing a 1,000-token blob in "
                                "prefills of it (CPU), as the policy weighs it: its prior, then measured",
                                value=measured["compress_prefills"])
