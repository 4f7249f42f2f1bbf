"""Concurrent users replaying real ShareGPT turns against `statekeeper serve`, measured from outside: the
default compression, lossless storage and no stored state, side by side in one run (issue 13).

    python -m benchmarks.multiround --users 6 --rounds 5 --repeats 2 --json multiround.json

Each configuration starts its own service (a subprocess on a fresh data directory, talked to over HTTP)
and replays the same seeded schedule, one asyncio task per user: user i replays the first --rounds user
messages of its own ShareGPT conversation (each cut to --max-chars), greedy, --max-tokens per reply.
Before each turn the user thinks for 0.5-2 s; before each turn after the first it is also away for an
idle gap drawn from --gaps (simulated seconds, scaled by --time-scale), and the service's idle offload
and compress-after thresholds are scaled the same way, so a 5 min gap is offloaded (and compressed) and
a 1 s one is not. --active-kv-budget-mb holds only some of the users' KV at once.

    default   service defaults (compression in a child process, sessions/compress_process.py)
    value     PLACEMENT_POLICY=value named (the default since a271b80): the placement policy decides which
              blobs to compress and when
    lru       PLACEMENT_POLICY=lru: LRU, blobs compressed on the fixed --compress-after schedule (scaled), the
              default before a271b80
    lru-exact-copy  lru with an SSD tier keeping each compressed conversation's exact state
              (EXACT_COPY_TIER=ssd): restores of compressed blobs take the exact state there
    lru-working-set  lru-exact-copy with a 12x fast copy (COMPRESSION_KEEP=0.33) and the reply after a
              restore from the copy attending half the history (COMPRESSION_LIVE_KEEP=0.5)
    default-thread  the same compression on the model thread, between live steps
    lossless  each session created with {"compression": {"policy": "none", "codec": "none"}}
    unbatched, lossless-unbatched  the same with continuous batching off (BATCH_MAX_SESSIONS=1: each
              turn's steps run alone, as before issue 17)
    no-long-lane  the default with every prompt on the one model thread (LONG_PREFILL_LANE=off)
    chunk256  the default with prefills cut into 256-token chunks, 256 prefill tokens per step (not 512)
    threads2  the default with the model thread at 2 torch threads (STATEKEEPER_TORCH_THREADS=2)
    kv-bf16, kv-fp32  the default with the live KV cache in bfloat16 or float32 (STATEKEEPER_KV_DTYPE)
    gemm16    the default with the quantized layers' GEMM from 16 rows, not the measured crossover
              (STATEKEEPER_GEMM_ROWS)
    baseline  the service defaults of another checkout, --baseline-repo (e.g. a worktree of the commit
              before a change, to measure against "today's" service with the same workload and client)
    none      no tier that holds anything, no compression: a resumed turn whose KV left memory recomputes

TTFT is the client's: from sending the turn to its first streamed token, so it includes any wait for the
session's lock or the model thread. It is reported for resumed turns (a session's first turn has nothing
to restore), overall and by the restore source the service names. The start-up measurements (GEMM crossover,
KV dtype, restore profile) are made once, by an untimed start before the timed ones, and shared with every
configuration with stored state. none measures nothing at start (no restore planning): it is given the KV
dtype and GEMM row count the untimed start chose by KV_DTYPE and GEMM_ROWS. Each run keeps the KV dtype and
GEMM its service reported (GET /v1/admin/tiers); a ratio between two runs whose choices differ (other than one a
configuration sets on purpose, kv-fp32's KV dtype, gemm16's GEMM) is not computed: "not comparable: <why>"
(a baseline checkout that rejects the shared measurements, say, measures and may choose its own).

The table puts the configurations side by side (in --configs order within each repeat; the JSON keeps the
order they ran in), with default/lossless and x/none ratios of wall time, service time and p95 TTFT taken
within a repeat (a per-turn ratio over the turns, by user and round, that succeeded in both), and checks issue
13's targets. The service time is every turn's latency summed: the wall time is mostly the users' scripted think
time and gaps, the same in every configuration, so the wall-time target and the reply-rate ratios are taken on
the service time, the wall time shown beside them (runs before this change took them on the wall time);
a configuration with failed turns has their count beside its name, and a target it takes part in is NOT met.
Model thread and compression counters come from
GET /v1/admin/tiers at the end of each configuration ("—" where the service does not report them)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.harness import MODEL_CACHE, machine_line, machine_record, markdown_table, percentile, write_json
from benchmarks.harness.machine import REPO, checkout_commit
from benchmarks.harness.service_choices import (deliberate_choices, describe, pinned_choices, pinned_settings,
                                                reported_choices, why_not_comparable)

from statekeeper.evaluation.datasets import sharegpt_conversations

THINK_SECONDS = (0.5, 2.0)
LOSSLESS = {"policy": "none", "codec": "none"}
# The service refuses to start without a tier, so "no stored state" is a 1 MB DRAM tier that no blob fits
# (a 30-token history is already larger): every offloaded state is dropped and recomputed.
NO_STORED_STATE = {"STATEKEEPER_DRAM_BUDGET_MB": "1", "STATEKEEPER_LMDB_ENABLED": "false",
                   "STATEKEEPER_COMPRESSION_POLICY": "none", "STATEKEEPER_COMPRESSION_CODEC": "none",
                   "STATEKEEPER_RESTORE_PLANNING": "false"}


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    env: dict  # STATEKEEPER_* settings on top of the shared ones
    compression: dict | None  # the per-session override sent with POST /v1/sessions
    is_stored: bool = True  # keeps offloaded state (and so plans restores from the shared profile)
    observed: bool = False  # an operator watching: /metrics and the dashboard's API polled throughout


CONFIGS = {
    "default": Config("default", {}, None),
    # The same compression on the model thread (background jobs between live steps), not in the child process.
    "default-thread": Config("default-thread", {"STATEKEEPER_COMPRESS_PROCESS": "false"}, None),
    "lossless": Config("lossless", {}, LOSSLESS),
    "none": Config("none", NO_STORED_STATE, None, is_stored=False),
    # Continuous batching off (issue 17): every turn's step runs alone, as before batching.
    "unbatched": Config("unbatched", {"STATEKEEPER_BATCH_MAX_SESSIONS": "1"}, None),
    "lossless-unbatched": Config("lossless-unbatched", {"STATEKEEPER_BATCH_MAX_SESSIONS": "1"}, LOSSLESS),
    # Shorter steps: a returning user's prompt waits for at most a 256-token chunk of someone else's prefill.
    "chunk256": Config("chunk256", {"STATEKEEPER_PREFILL_CHUNK_TOKENS": "256", "STATEKEEPER_BATCH_PREFILL_TOKENS": "256"},
                       None),
    # One model thread for every prompt: no long lane beside it (scheduler/lanes.py; on by default on 2 cores).
    "no-long-lane": Config("no-long-lane", {"STATEKEEPER_LONG_PREFILL_LANE": "off"}, None),
    # The model thread at 2 torch threads (TORCH_THREADS): on 2 cores it leaves none free for I/O and HTTP.
    "threads2": Config("threads2", {"STATEKEEPER_TORCH_THREADS": "2"}, None),
    # The live KV cache in bfloat16 (KV_DTYPE), and float32, whichever the default is not.
    "kv-bf16": Config("kv-bf16", {"STATEKEEPER_KV_DTYPE": "bfloat16"}, None),
    "kv-fp32": Config("kv-fp32", {"STATEKEEPER_KV_DTYPE": "float32"}, None),
    "gemm16": Config("gemm16", {"STATEKEEPER_GEMM_ROWS": "16"}, None),
    # The placement policies (issue 32): the expected value (the default since a271b80: it decides what to
    # compress when), and LRU with compression on the fixed (scaled) --compress-after schedule, the default before.
    "value": Config("value", {"STATEKEEPER_PLACEMENT_POLICY": "value"}, None),
    "lru": Config("lru", {"STATEKEEPER_PLACEMENT_POLICY": "lru"}, None),
    # LRU (compression on schedule, so blobs do get compressed in a short run) with the exact states kept on SSD
    # beside the compressed blobs, restores taking them (issue 33, EXACT_COPY_TIER).
    "lru-exact-copy": Config("lru-exact-copy", {"STATEKEEPER_PLACEMENT_POLICY": "lru", "STATEKEEPER_SSD_ENABLED": "true",
                                                "STATEKEEPER_EXACT_COPY_TIER": "ssd"}, None),
    # The same with a 12x fast copy (keep 0.33) whose restores from the copy let the reply attend half the
    # history (COMPRESSION_LIVE_KEEP=0.5), the prompt every row (issue 33's working set).
    "lru-working-set": Config("lru-working-set", {"STATEKEEPER_PLACEMENT_POLICY": "lru",
                                                  "STATEKEEPER_SSD_ENABLED": "true", "STATEKEEPER_EXACT_COPY_TIER": "ssd",
                                                  "STATEKEEPER_COMPRESSION_KEEP": "0.33",
                                                  "STATEKEEPER_COMPRESSION_LIVE_KEEP": "0.5"}, None),
    "baseline": Config("baseline", {}, None),  # run from --baseline-repo
    # The default with Prometheus and an open dashboard polling it (issue 16's cost of being watched).
    "default-observed": Config("default-observed", {}, None, observed=True),
}

# What a watched service answers, every OBSERVE_INTERVAL_S: Prometheus' scrape and the dashboard's polls.
OBSERVED_PATHS = ("/metrics", "/v1/admin/tiers", "/v1/admin/history", "/v1/admin/conversations?limit=50")
OBSERVE_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class Turn:
    user: int
    round: int
    content: str
    gap_s: float  # simulated idle gap before this turn (0 before the first)
    wait_s: float  # real seconds before sending: think time + the scaled gap


# -- workload --------------------------------------------------------------------------------------


def pick_users(num_users: int, rounds: int, min_user_chars: int, max_chars: int, source: Path | None = None
               ) -> list[list[str]]:
    """The first ShareGPT conversations (of the file `source` where given) with >= `rounds` user turns whose
    first `rounds` messages hold >= `min_user_chars` characters (so that histories reach the lengths where
    restoring matters)."""
    picked = []
    for conversation in sharegpt_conversations(min_turns=rounds, path=source):
        messages = [content[:max_chars] for role, content in conversation if role == "user"][:rounds]
        if sum(len(m) for m in messages) >= min_user_chars:
            picked.append(messages)
            if len(picked) == num_users:
                return picked
    raise SystemExit(f"only {len(picked)} ShareGPT conversations fit --rounds {rounds} and --min-user-chars")


def build_schedule(users: list[list[str]], gaps: list[float], time_scale: float, seed: int) -> list[list[Turn]]:
    rng = random.Random(seed)
    schedule = []
    for user, messages in enumerate(users):
        turns = []
        for round_index, content in enumerate(messages):
            gap = rng.choice(gaps) if round_index else 0.0
            turns.append(Turn(user, round_index, content, gap, rng.uniform(*THINK_SECONDS) + gap * time_scale))
        schedule.append(turns)
    return schedule


def gap_counts(schedule: list[list[Turn]]) -> str:
    gaps = [turn.gap_s for turns in schedule for turn in turns[1:]]
    return ", ".join(f"{gap:g} s ×{gaps.count(gap)}" for gap in sorted(set(gaps)))


# -- the service -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A server in a subprocess on a free loopback port, up once GET `health_path` answers 200; start() and
    stop() return the seconds they took. A subclass says how it starts: `command`, `cwd` and `env`."""

    name = "server"
    health_path = "/healthz"

    def __init__(self, log_path: Path, poll_seconds: float = 0.5, own_process_group: bool = False):
        self.log_path = log_path
        self.poll_seconds = poll_seconds  # how often start() asks, the resolution of the time it returns
        self.own_process_group = own_process_group
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.cwd: Path | None = None
        self.env: dict[str, str] | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 600) -> float:
        started = time.perf_counter()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command(), cwd=self.cwd, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=self.own_process_group)
        while time.perf_counter() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=5).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(self.poll_seconds)
        self.stop()
        raise RuntimeError(f"{self.name} not up after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 300) -> float:
        """SIGINT: a graceful shutdown (for statekeeper what it costs is part of the result: the active KV
        is offloaded), SIGKILL past `timeout_s`."""
        started = time.perf_counter()
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        return time.perf_counter() - started

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class ServiceProcess(ServerProcess):
    """`statekeeper serve` on a fresh data directory. `own_process_group`: the service (and so its
    compression child) runs in a process group of its own, which os.killpg(process.pid, ...) reaches whole
    (benchmarks/crash.py); `repo`: the checkout it runs from."""

    name = "service"

    def __init__(self, data_dir: Path, env: dict[str, str], own_process_group: bool = False,
                 poll_seconds: float = 0.5, repo: Path = REPO):
        super().__init__(data_dir / "serve.log", poll_seconds, own_process_group)
        self.data_dir = data_dir
        self.cwd = repo
        # `repo` first (a baseline worktree's statekeeper, not this one's); then what the caller's path held (the
        # packages a lent GPU machine gets from .whl/ live there).
        paths = [str(repo)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = os.environ | env | {"PYTHONPATH": os.pathsep.join(paths)}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "statekeeper.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--data-dir", str(self.data_dir)]


def service_env(config: Config, args: argparse.Namespace, admin_token: str) -> dict[str, str]:
    scaled = {"STATEKEEPER_IDLE_OFFLOAD_SECONDS": args.idle_offload * args.time_scale,
              "STATEKEEPER_COMPRESS_AFTER_SECONDS": args.compress_after * args.time_scale}
    return {
        "STATEKEEPER_MODEL": args.model,
        "STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache),
        "STATEKEEPER_ADMIN_TOKEN": admin_token,
        "STATEKEEPER_ACTIVE_KV_BUDGET_MB": str(args.active_kv_budget_mb),
        **{name: f"{seconds:g}" for name, seconds in scaled.items()},
        **config.env,
    }


# -- the users -------------------------------------------------------------------------------------


async def send_turn(client: httpx.AsyncClient, session_id: str, turn: Turn, max_tokens: int) -> dict:
    """One streamed turn; the TTFT is the first streamed event, the rest comes from the final one."""
    record = {"user": turn.user, "round": turn.round, "gap_s": turn.gap_s}
    body = {"content": turn.content, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft_ms, final = None, None
    try:
        async with client.stream("POST", f"/v1/sessions/{session_id}/messages", json=body) as response:
            if response.status_code != 200:
                return record | {"status": response.status_code, "error": (await response.aread()).decode()[:500]}
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                ttft_ms = ttft_ms or (time.perf_counter() - started) * 1000
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return record | {"status": 200, "error": f"mid-stream: {event['error']}"}
                if event.get("done"):
                    final = event
    except httpx.HTTPError as exc:
        return record | {"status": None, "error": repr(exc)}
    if final is None:
        return record | {"status": 200, "error": "stream ended without a result"}
    return record | {
        "status": 200,
        "error": None,
        "source": final["restore"]["source"] if turn.round else "first",
        "ttft_ms": ttft_ms,
        "latency_ms": (time.perf_counter() - started) * 1000,
        "server_ttft_ms": final["timings"]["ttft_ms"],
        "restore_ms": final["restore"]["ms"],
        "layerwise": (final["restore"].get("layerwise") or {}).get("measured"),  # a compressed blob's timeline
        "device": final["restore"].get("device"),  # a GPU worker's restore report
        "lock_wait_ms": final["timings"].get("lock_wait_ms"),  # where a slow first token waited
        "first_queue_ms": final["timings"].get("first_queue_ms"),
        "prompt_tokens": final["usage"]["prompt_tokens"],
        "cached_tokens": final["usage"]["cached_tokens"],
        "completion_tokens": final["usage"]["completion_tokens"],
    }


async def replay_user(client: httpx.AsyncClient, turns: list[Turn], config: Config, max_tokens: int) -> list[dict]:
    response = await client.post("/v1/sessions", json={"compression": config.compression} if config.compression else {})
    if response.status_code != 201:
        return [{"user": turns[0].user, "round": -1, "status": response.status_code, "error": response.text[:500]}]
    session_id = response.json()["id"]
    records = []
    for turn in turns:
        await asyncio.sleep(turn.wait_s)
        records.append(await send_turn(client, session_id, turn, max_tokens))
    return records


async def observe(client: httpx.AsyncClient, admin_token: str, polls: list[dict]) -> None:
    """Polls OBSERVED_PATHS until cancelled, as Prometheus and an open dashboard would."""
    headers = {"Authorization": f"Bearer {admin_token}"}
    while True:
        for path in OBSERVED_PATHS:
            started = time.perf_counter()
            response = await client.get(path, headers=headers)
            polls.append({"path": path, "status": response.status_code, "ms": (time.perf_counter() - started) * 1000})
        await asyncio.sleep(OBSERVE_INTERVAL_S)


async def replay(url: str, schedule: list[list[Turn]], config: Config, args, admin_token: str) -> dict:
    polls: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:  # a hung turn becomes an error
        watcher = asyncio.ensure_future(observe(client, admin_token, polls)) if config.observed else None
        started = time.perf_counter()
        per_user = await asyncio.gather(*(replay_user(client, turns, config, args.max_tokens) for turns in schedule))
        wall_s = time.perf_counter() - started
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        admin = await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})
    return {"wall_s": wall_s, "turns": [r for records in per_user for r in records], "polls": polls,
            "admin": admin.json() if admin.status_code == 200 else {"status": admin.status_code, "body": admin.text}}


def measuring_config(names: list[str]) -> Config:
    """The configuration the untimed start runs as: the first of `names` that keeps state (its tiers are the
    restore profile's) and runs this checkout, else the default."""
    return next((CONFIGS[name] for name in names if CONFIGS[name].is_stored and name != "baseline"), CONFIGS["default"])


def admin_stats(url: str, admin_token: str) -> dict:
    """GET /v1/admin/tiers ({} where it does not answer)."""
    response = httpx.get(f"{url}/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
    return response.json() if response.status_code == 200 else {}


def measure_profiles(config: Config, args, root: Path) -> dict:
    """One untimed start that only measures: the GEMM crossover, the KV dtype and the restore profile land in
    root/profiles, which every timed start then reads. Without it the first timed configuration measured them
    in the process it was timed in, and it alone ran beside those measurements' after-effects. Returns the
    choices it made (service_choices.reported_choices)."""
    data_dir = Path(tempfile.mkdtemp(prefix="measure-", dir=root))
    admin_token = secrets.token_hex(16)
    service = ServiceProcess(data_dir, service_env(config, args, admin_token))
    service.start()
    try:
        measured = reported_choices(admin_stats(service.url, admin_token))
    finally:
        service.stop()
    if (data_dir / "profiles").exists():
        shutil.copytree(data_dir / "profiles", root / "profiles")
    return measured


def measures_at_start(config: Config) -> bool:
    """Whether the service measures the GEMM crossover and KV dtype at start: not without restore planning."""
    return config.env.get("STATEKEEPER_RESTORE_PLANNING") != "false"


def run_config(config: Config, schedule: list[list[Turn]], args, root: Path, measured: dict | None = None) -> dict:
    """One timed configuration. A service that measures nothing at start is given what the untimed start
    measured (`measured`) by its settings, or it would run the settings' rule: another KV dtype, another GEMM."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"{config.name}-", dir=root))
    shared_profiles = root / "profiles"
    if config.is_stored and shared_profiles.exists():
        shutil.copytree(shared_profiles, data_dir / "profiles")
    admin_token = secrets.token_hex(16)
    repo = args.baseline_repo if config.name == "baseline" else REPO
    pinned = {} if measures_at_start(config) else pinned_settings(measured or {})
    service = ServiceProcess(data_dir, service_env(config, args, admin_token) | pinned, repo=repo)
    start_s = service.start()
    try:
        result = asyncio.run(replay(service.url, schedule, config, args, admin_token))
    finally:
        stop_s = service.stop()
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            shutil.copy(data_dir / "serve.log", args.logs / f"{config.name}-{data_dir.name}.log")
    choices = pinned_choices(reported_choices(result["admin"]), pinned)
    return {"config": config.name, "start_s": start_s, "stop_s": stop_s, "choices": choices,
            "deliberate": deliberate_choices(config.env)} | result


# -- the report ------------------------------------------------------------------------------------


def summarize(run: dict) -> dict:
    done = [t for t in run["turns"] if t["error"] is None]
    resumed = [t for t in done if t["source"] != "first"]
    by_source = {}
    for source in sorted({t["source"] for t in done}):
        ttfts = [t["ttft_ms"] for t in done if t["source"] == source]
        by_source[source] = {"n": len(ttfts), "p50": percentile(ttfts, 0.5), "p95": percentile(ttfts, 0.95)}
    ttfts = [t["ttft_ms"] for t in resumed]
    errors = [t for t in run["turns"] if t["error"] is not None]
    service_s = sum(t["latency_ms"] for t in done) / 1000
    return {
        "config": run["config"],
        "wall_s": run["wall_s"],
        "turns": len(done),
        "turns_per_s": len(done) / run["wall_s"],
        # Reply tokens over the run's wall time (think time and gaps included: what the users got).
        "completion_tokens_per_s": sum(t["completion_tokens"] for t in done) / run["wall_s"],
        # The service's time: every turn's latency summed (users overlap, so it can exceed the wall time). The
        # wall time is mostly the users' scripted think time and gaps, the same for every configuration, which
        # dilutes any difference in it; the service time is what a configuration changes.
        "service_s": service_s,
        "service_tokens_per_s": sum(t["completion_tokens"] for t in done) / service_s if service_s else None,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p95_ms": percentile(ttfts, 0.95),
        "ttft_by_source": by_source,
        "latency_p50_ms": percentile([t["latency_ms"] for t in done], 0.5),  # request to the reply's end
        "polls": len(run.get("polls", [])),  # an observed run's scrapes and dashboard polls
        "poll_p50_ms": percentile([p["ms"] for p in run.get("polls", [])], 0.5),
        "errors": len(errors),
        "first_errors": [{k: t[k] for k in ("user", "round", "status", "error")} for t in errors[:3]],
        "model_thread": run["admin"].get("model_thread"),
        "compression": run["admin"].get("compression"),
        # What the tiers held at the end: a policy that compresses less keeps more bytes for faster restores.
        "stored_mb": sum(tier.get("usage_bytes", 0) for tier in run["admin"].get("tiers", [])) / 1e6
        if run["admin"].get("tiers") else None,
        "start_s": run["start_s"],
        "stop_s": run["stop_s"],
        "choices": run_choices(run),
        "deliberate": run.get("deliberate", []),  # the choices its own settings make
        # Each turn that succeeded, for ratios over the turns that succeeded in both configurations.
        "turn_times": [{key: t[key] for key in ("user", "round", "ttft_ms", "latency_ms")} for t in done],
    }


def run_choices(run: dict) -> dict:
    """The KV dtype and GEMM a run's service ran (a file from before they were recorded: as its admin reported)."""
    return run.get("choices") or reported_choices(run.get("admin") or {})


def why_not_comparable_runs(summaries: list[dict], config: str, of: str) -> str | None:
    """Why `config`'s figures in one repeat cannot be divided by `of`'s (other kernels), or None."""
    by_name = {s["config"]: s for s in summaries}
    mine, theirs = by_name.get(config, {}), by_name.get(of, {})
    deliberate = {*mine.get("deliberate", []), *theirs.get("deliberate", [])}
    return why_not_comparable(mine.get("choices"), theirs.get("choices"), deliberate)


# The summaries' figures taken over turns: (the turn's field, the statistic of those, resumed turns only).
PER_TURN = {"ttft_p50_ms": ("ttft_ms", lambda v: percentile(v, 0.5), True),
            "ttft_p95_ms": ("ttft_ms", lambda v: percentile(v, 0.95), True),
            "latency_p50_ms": ("latency_ms", lambda v: percentile(v, 0.5), False),
            "service_s": ("latency_ms", sum, False)}


def paired_ratio(mine: list[dict], theirs: list[dict], key: str) -> float | None:
    """`key` (PER_TURN) over the (user, round) turns that succeeded in both: a turn that failed on one side only
    would take a slow (or fast) turn out of that side's figure alone."""
    field, statistic, resumed_only = PER_TURN[key]
    times = [{(t["user"], t["round"]): t[field] for t in turns if t["round"] > 0 or not resumed_only}
             for turns in (mine, theirs)]
    both = sorted(times[0].keys() & times[1].keys())
    over = statistic([times[1][turn] for turn in both]) if both else None
    return statistic([times[0][turn] for turn in both]) / over if over else None


def ratio(summaries: list[dict], config: str, of: str, key: str) -> float | None:
    """`config`'s value of `key` over `of`'s, within one repeat (a per-turn percentile over the turns that
    succeeded in both: paired_ratio); None where either is missing or the two ran other kernels
    (why_not_comparable_runs)."""
    by_name = {s["config"]: s for s in summaries}
    mine, theirs = by_name.get(config), by_name.get(of)
    if mine is None or theirs is None or mine.get(key) is None or not theirs.get(key) \
            or why_not_comparable_runs(summaries, config, of):
        return None
    if key in PER_TURN and "turn_times" in mine and "turn_times" in theirs:
        return paired_ratio(mine["turn_times"], theirs["turn_times"], key)
    return mine[key] / theirs[key]


def errors_note(summaries: list[dict], names) -> str:
    """"errors: default 2, none 1" for those of `names` with failed turns ("" for none)."""
    failed = [f"{s['config']} {s['errors']}" for s in summaries if s["config"] in names and s.get("errors")]
    return f"errors: {', '.join(failed)}" if failed else ""


def ratio_cell(summaries: list[dict], config: str, of: str, key: str) -> str:
    reason = why_not_comparable_runs(summaries, config, of) if config != of else None
    return f"not comparable: {reason}" if reason else cell(ratio(summaries, config, of, key), 3)


def cell(value, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def column(s: dict, repeat: list[dict], sources: list[str]) -> list[str]:
    """One configuration's cells, in the order of configs_table's labels."""
    by_source = [f"{cell(s['ttft_by_source'][source]['p50'], 0)} / {cell(s['ttft_by_source'][source]['p95'], 0)} "
                 f"({s['ttft_by_source'][source]['n']})" if source in s["ttft_by_source"] else "—"
                 for source in sources]
    model_thread, compression = s["model_thread"] or {}, s["compression"] or {}
    mean_batch = (model_thread["batch_sessions"] / model_thread["batch_steps"]
                  if model_thread.get("batch_steps") else None)
    return [
        cell(s["wall_s"]), cell(s.get("service_s")), cell(s["turns_per_s"], 3),
        cell(s.get("completion_tokens_per_s"), 2),
        cell(s.get("service_tokens_per_s"), 2), cell(mean_batch, 2),
        cell(s["ttft_p50_ms"], 0), cell(s["ttft_p95_ms"], 0),
        *by_source,
        str(s["errors"]),
        cell(model_thread.get("live_seconds")), cell(model_thread.get("background_seconds")),
        cell(compression.get("process_cpu_seconds")),
        " / ".join(cell(compression.get(key), 0) for key in ("compressed", "cancelled", "failed", "queued",
                                                              "declined")),
        cell(s.get("stored_mb")),
        " / ".join(cell((compression.get("exact_copies") or {}).get(key), 0) for key in ("kept", "restores", "missing")),
        *(ratio_cell(repeat, s["config"], of, key) for key in ("wall_s", "service_s", "ttft_p95_ms")
          for of in ("lossless", "none")),
        f"{cell(s['start_s'])} / {cell(s['stop_s'])}",
        describe(s.get("choices")),
    ]


def configs_table(repeats: list[list[dict]]) -> str:
    """Configurations side by side (a column each, per repeat), measures down."""
    sources = sorted({source for repeat in repeats for s in repeat for source in s["ttft_by_source"]})
    labels = ["wall time s", "service time s (turn latencies summed)", "turns/s", "reply tokens/s (wall)",
              "reply tokens/s (service time)", "mean batch (sessions per step)",
              "resumed TTFT p50 ms", "resumed TTFT p95 ms",
              *(f"TTFT p50 / p95 ms: {source} (n)" for source in sources),
              "errors", "model thread live s", "model thread compression s", "compression process CPU s",
              "compressed / cancelled / failed / queued / declined", "stored MB at the end (all tiers)",
              "exact copies kept / restores from them / missing",
              "wall time ÷ lossless", "wall time ÷ none", "service time ÷ lossless", "service time ÷ none",
              "p95 TTFT ÷ lossless", "p95 TTFT ÷ none",
              "service start / stop s", "KV dtype, GEMM (as the service reported them)"]
    names = [s["config"] + (f" #{i + 1}" if len(repeats) > 1 else "")
             + (f" ({s['errors']} errors)" if s["errors"] else "")  # beside every figure of the column
             for i, repeat in enumerate(repeats) for s in repeat]
    columns = [column(s, repeat, sources) for repeat in repeats for s in repeat]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, *cells in zip(labels, *columns)]
    return "\n".join(lines)


def incomparable_lines(repeats: list[list[dict]], pairs) -> list[str]:
    """A line for each pair of configurations (`pairs`: (config, of)) that ran in a repeat on other kernels."""
    lines = []
    for i, summaries in enumerate(repeats):
        ran = {s["config"] for s in summaries}
        for config, of in pairs:
            reason = why_not_comparable_runs(summaries, config, of) if {config, of} <= ran else None
            if reason:
                lines.append(f"repeat {i + 1}: {config}/{of} not comparable: {reason}")
    return lines


def target_lines(repeats: list[list[dict]]) -> list[str]:
    """Issue 13's targets: default ≤ 1.03× lossless in service time (the turns' latencies summed; the wall
    time, mostly scripted think time, beside it), ≤ 1.1× in p95 TTFT; both beat none."""
    lines = incomparable_lines(repeats, [("default", "lossless"), ("default", "none"), ("lossless", "none"),
                                         ("default", "unbatched"), ("lossless", "lossless-unbatched"),
                                         ("default", "baseline"), ("default-observed", "default")])
    for i, summaries in enumerate(repeats):
        service = ratio(summaries, "default", "lossless", "service_s")
        wall = ratio(summaries, "default", "lossless", "wall_s")
        p95 = ratio(summaries, "default", "lossless", "ttft_p95_ms")
        beats_none = [ratio(summaries, name, "none", key) for name in ("default", "lossless")
                      for key in ("service_s", "ttft_p95_ms")]
        if service is None or wall is None or p95 is None or None in beats_none:
            continue
        errors = errors_note(summaries, ("default", "lossless", "none"))
        met = service <= 1.03 and p95 <= 1.1 and all(r < 1 for r in beats_none) and not errors
        lines.append(f"repeat {i + 1}: default/lossless service time {service:.3f}× (≤ 1.03; wall {wall:.3f}×), "
                     f"p95 TTFT {p95:.3f}× (≤ 1.1); "
                     f"default and lossless beat none in both: {all(r < 1 for r in beats_none)}"
                     f"{'; ' + errors if errors else ''} -> {'targets met' if met else 'targets NOT met'}")
    for i, summaries in enumerate(repeats):  # issue 17: batching halves the resumed p95 at 8 users
        for name, of in (("default", "unbatched"), ("lossless", "lossless-unbatched"), ("default", "baseline")):
            p95, p50 = (ratio(summaries, name, of, key) for key in ("ttft_p95_ms", "ttft_p50_ms"))
            rate = ratio(summaries, name, of, "service_tokens_per_s")
            wall_rate = ratio(summaries, name, of, "completion_tokens_per_s")
            if None not in (p95, p50, rate, wall_rate):
                errors = errors_note(summaries, (name, of))
                lines.append(f"repeat {i + 1}: {name}/{of} resumed TTFT p50 {p50:.3f}×, p95 {p95:.3f}× (≤ 0.5 at 8 "
                             f"users), reply tokens per service second {rate:.3f}× (per wall second {wall_rate:.3f}×)"
                             + (f" ({errors}: target NOT met)" if errors else ""))
    for i, summaries in enumerate(repeats):  # issue 16: being watched costs <= 1% of turn latency
        watched = [ratio(summaries, "default-observed", "default", key)
                   for key in ("latency_p50_ms", "ttft_p50_ms", "ttft_p95_ms", "service_s", "wall_s")]
        if None not in watched:
            polls = next(s for s in summaries if s["config"] == "default-observed")
            errors = errors_note(summaries, ("default-observed", "default"))
            lines.append(f"repeat {i + 1}: observed/default turn latency p50 {watched[0]:.3f}×, TTFT p50 "
                         f"{watched[1]:.3f}×, p95 {watched[2]:.3f}×, service time {watched[3]:.3f}× (wall "
                         f"{watched[4]:.3f}×; {polls['polls']} polls, p50 {polls['poll_p50_ms']:.1f} ms)"
                         + (f" ({errors}: target NOT met)" if errors else ""))
    return lines


def why_pools_not_comparable(runs: list[dict], reference_runs: list[dict]) -> str | None:
    """Why one configuration's pooled runs cannot be divided by the reference's: a pair that ran other kernels."""
    for run in runs:
        for other in reference_runs:
            deliberate = {*run.get("deliberate", []), *other.get("deliberate", [])}
            reason = why_not_comparable(run_choices(run), run_choices(other), deliberate)
            if reason:
                return reason
    return None


def pooled_table(paths: list[Path], reference: str = "lossless") -> str:
    """Resumed-turn TTFT pooled over every repeat in saved runs (--json files of the same schedule): with
    ~24 resumed turns a repeat, one repeat's p95 is about its second-slowest turn, so the pooled figure is
    the steadier comparison. The ratios to `reference` are over the turns that succeeded in both (the same
    file, repeat, user and round); each configuration's failed turns are counted beside its figures. Wall time
    is the median of the repeats'."""
    saved = [json.loads(Path(path).read_text()) for path in paths]
    if any(s["schedule"] != saved[0]["schedule"] for s in saved):
        raise SystemExit("these runs replayed different schedules: nothing to pool")
    check_same_commits(saved)
    pooled = pool_runs(saved)
    of = pooled.get(reference, {"runs": [], "resumed": {}})
    rows = []
    for name, mine in pooled.items():
        values = list(mine["resumed"].values())
        reason = why_pools_not_comparable(mine["runs"], of["runs"])
        if reason:
            ratios = [f"not comparable: {reason}"] * 2
        else:
            ratios = [cell(pooled_ratio(mine["resumed"], of["resumed"], quantile), 3) for quantile in (0.5, 0.95)]
        rows.append([name, len(mine["runs"]), len(values), cell(percentile(values, 0.5), 0),
                     cell(percentile(values, 0.95), 0), *ratios,
                     cell(statistics.median(run["wall_s"] for run in mine["runs"])), mine["errors"]])
    return markdown_table(["configuration", "repeats", "resumed turns", "TTFT p50 ms", "TTFT p95 ms",
                           f"p50 ÷ {reference}", f"p95 ÷ {reference}", "median wall s", "failed turns"], rows)


def recorded_commit(config: str, machine: dict) -> str | None:
    """The commit `config` ran in a saved run: the baseline checkout's for baseline, this checkout's for the
    others; None where the file does not say (one from before the baseline's was recorded)."""
    return machine.get("baseline_commit" if config == "baseline" else "commit")


def check_same_commits(saved: list[dict]) -> None:
    """Exits where one configuration ran other code in two of the saved runs: pooling them mixes two services."""
    commits: dict[str, set[str]] = {}
    for results in saved:
        for config in {run["config"] for run in results["runs"]}:
            commit = recorded_commit(config, results.get("machine") or {})
            if commit is not None:
                commits.setdefault(config, set()).add(commit)
    mixed = {config: found for config, found in commits.items() if len(found) > 1}
    if mixed:
        raise SystemExit("these runs ran other code: " + "; ".join(
            f"{config} at {', '.join(sorted(found))}" for config, found in mixed.items()) + ": nothing to pool")


def pool_runs(saved: list[dict]) -> dict[str, dict]:
    """Per configuration: its runs, its resumed turns' TTFTs by (file, repeat, user, round), its failed turns."""
    pooled = {}
    for index, results in enumerate(saved):
        for run in results["runs"]:
            mine = pooled.setdefault(run["config"], {"runs": [], "resumed": {}, "errors": 0})
            mine["runs"].append(run)
            mine["errors"] += sum(t["error"] is not None for t in run["turns"])
            mine["resumed"] |= {(index, run.get("repeat", 0), t["user"], t["round"]): t["ttft_ms"]
                                for t in run["turns"] if t["error"] is None and t["round"] > 0}
    return pooled


def pooled_ratio(mine: dict, theirs: dict, quantile: float) -> float | None:
    """`mine`'s percentile over `theirs`', over the turns both hold."""
    both = mine.keys() & theirs.keys()
    over = percentile([theirs[turn] for turn in both], quantile)
    return percentile([mine[turn] for turn in both], quantile) / over if over else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5, help="turns per user")
    parser.add_argument("--configs", default="default,lossless,none", type=lambda v: v.split(","),
                        help=f"comma-separated, run in this order: {','.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=1, help="run the set again (in reverse order every other time)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=4000, help="user messages are cut to this many characters")
    parser.add_argument("--min-user-chars", type=int, default=3000,
                        help="pick conversations whose first --rounds user messages hold this many characters")
    parser.add_argument("--gaps", default="1,30,300", type=lambda v: [float(x) for x in v.split(",")],
                        help="simulated idle gaps (s) before each turn after a user's first, drawn at random")
    parser.add_argument("--time-scale", type=float, default=0.1, help="real seconds per simulated second")
    parser.add_argument("--idle-offload", type=float, default=60.0, help="simulated idle offload threshold (s)")
    parser.add_argument("--compress-after", type=float, default=120.0,
                        help="simulated idle time (s) before a stored blob is compressed (PLACEMENT_POLICY=lru)")
    parser.add_argument("--active-kv-budget-mb", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="smollm2", help="the services' model: smollm2 or a local model directory")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--conversations", type=Path,
                        help="a JSON file in ShareGPT's format to take the users from instead of the wheel")
    parser.add_argument("--logs", type=Path, help="keep each service's log in this directory")
    parser.add_argument("--json", help="write the summaries and every turn here")
    parser.add_argument("--baseline-repo", type=Path, help="the checkout the baseline config's service runs from")
    parser.add_argument("--pool", nargs="+", type=Path, metavar="JSON",
                        help="run nothing: pool the resumed turns of these saved runs (same schedule, and each "
                             "configuration at the same commit) per configuration")
    parser.add_argument("--pool-reference", default="lossless", help="the configuration pooled ratios are taken of")
    args = parser.parse_args(argv)
    if args.pool:
        print(pooled_table(args.pool, args.pool_reference))
        return
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}: choose from {','.join(CONFIGS)}")
    if "baseline" in args.configs and not (args.baseline_repo and (args.baseline_repo / "statekeeper").is_dir()):
        parser.error("the baseline config needs --baseline-repo, a checkout of statekeeper")
    if max(THINK_SECONDS) + max((g for g in args.gaps if g < args.idle_offload), default=0) * args.time_scale >= \
            args.idle_offload * args.time_scale:
        print("note: think time + the longest gap under the idle threshold can reach the scaled threshold: "
              "some short gaps will be offloaded too (raise --time-scale)", flush=True)

    # The baseline's code, next to machine.commit (this checkout's): --pool refuses runs of other code.
    baseline_commit = {"baseline_commit": checkout_commit(args.baseline_repo)} if args.baseline_repo else {}
    schedule = build_schedule(pick_users(args.users, args.rounds, args.min_user_chars, args.max_chars,
                                         args.conversations),
                              args.gaps, args.time_scale, args.seed)
    runs, repeats = [], []
    with tempfile.TemporaryDirectory(prefix="statekeeper-multiround-") as root:
        measured = measure_profiles(measuring_config(args.configs), args, Path(root))
        for repeat in range(args.repeats):
            order = args.configs if repeat % 2 == 0 else args.configs[::-1]
            summaries = []
            for name in order:
                run = run_config(CONFIGS[name], schedule, args, Path(root), measured) | {"repeat": repeat}
                runs.append(run)
                summaries.append(summarize(run))
                print(json.dumps({k: summaries[-1][k] for k in ("config", "wall_s", "ttft_p50_ms", "ttft_p95_ms",
                                                                 "errors", "start_s", "stop_s")}), flush=True)
            repeats.append(sorted(summaries, key=lambda s: args.configs.index(s["config"])))  # same columns each time

    print(f"\nmachine: {machine_line()}; {args.users} users × {args.rounds} rounds, "
          f"max_tokens {args.max_tokens}; simulated gaps drawn {gap_counts(schedule)} × {args.time_scale:g}, idle "
          f"offload {args.idle_offload:g} s × {args.time_scale:g}, active KV budget {args.active_kv_budget_mb} MB\n")
    print(configs_table(repeats))
    for line in target_lines(repeats):
        print(line)
    for summaries in repeats:
        for s in summaries:
            for error in s["first_errors"]:
                print(f"{s['config']} error: {error}")
    if args.json:
        recorded = vars(args) | {key: str(vars(args)[key]) for key in ("model_cache", "baseline_repo", "conversations",
                                                                      "logs")}
        write_json(args.json, {"args": recorded, "schedule": [[asdict(t) for t in turns] for turns in schedule],
                               "summaries": repeats, "runs": runs}, machine_record() | baseline_commit)


if __name__ == "__main__":
    main()
