"""A long run of concurrent ShareGPT users against `statekeeper serve` (issue 14 item 5): does memory stay
flat within the configured budgets, does TTFT drift, does anything fail?

    python -m benchmarks.soak --users 8 --minutes 30 --json soak.json

Each user replays real ShareGPT conversations one after another (user i takes conversations i, i + N,
i + 2N, ...), each in a new session, --rounds user turns per session with 0.5-2 s of think time and now
and then an idle gap long enough for the service's idle offload, so sessions accumulate: active, then
stored, then idle conversations the service may drop from memory (MAX_IDLE_SESSIONS). Every
--sample-seconds the sampler records the resident memory of the service and of its compression child
(/proc) and the admin stats (sessions in memory, active KV, tier usage). The report gives, per window of
--window-minutes: RSS, TTFT p50/p95 and errors."""

from __future__ import annotations

import argparse
import asyncio
import random
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.multiround import THINK_SECONDS, ServiceProcess, Turn, send_turn
from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json
from statekeeper.evaluation.datasets import sharegpt_conversations


def conversations(rounds: int, max_chars: int):
    """Endless: ShareGPT conversations with >= `rounds` user turns, as their first `rounds` user messages."""
    while True:
        for conversation in sharegpt_conversations(min_turns=rounds):
            messages = [content[:max_chars] for role, content in conversation if role == "user"][:rounds]
            if len(messages) == rounds and all(messages):
                yield messages


def rss_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process and its children (the compression process), in MB: in all, anonymous
    (the heap: what must stay flat) and file-backed (mapped files, LMDB's map among them: page cache the
    kernel can take back, bounded by the maps' sizes)."""
    total = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
    for task in [pid, *_children(pid)]:
        try:
            status = Path(f"/proc/{task}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            name = line.split(":")[0]
            if name in total:
                total[name] += int(line.split()[1])
    return {"rss_mb": total["VmRSS"] / 1024, "anon_mb": total["RssAnon"] / 1024, "file_mb": total["RssFile"] / 1024}


def _children(pid: int) -> list[int]:
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    children = [int(child) for child in found]
    return children + [grandchild for child in children for grandchild in _children(child)]


async def user(client: httpx.AsyncClient, index: int, args, stop_at: float, records: list[dict]) -> None:
    rng = random.Random(args.seed * 1000 + index)
    stream = conversations(args.rounds, args.max_chars)
    for _ in range(index):  # user i starts at conversation i, then takes every N-th
        next(stream)
    while time.monotonic() < stop_at:
        messages = next(stream)
        for _ in range(args.users - 1):
            next(stream)
        response = await client.post("/v1/sessions", json={})
        if response.status_code != 201:
            records.append({"t": time.monotonic(), "status": response.status_code, "error": response.text[:300]})
            await asyncio.sleep(1)
            continue
        session_id = response.json()["id"]
        for round_index, content in enumerate(messages):
            gap = args.idle_gap if rng.random() < args.idle_probability else 0.0
            await asyncio.sleep(rng.uniform(*THINK_SECONDS) + gap)
            if time.monotonic() >= stop_at:
                return
            turn = Turn(index, round_index, content, gap, 0.0)
            record = await send_turn(client, session_id, turn, args.max_tokens)
            records.append(record | {"t": time.monotonic()})


async def sampler(client: httpx.AsyncClient, pid: int, token: str, args, stop_at: float, samples: list[dict]):
    while time.monotonic() < stop_at:
        sample = {"t": time.monotonic()} | rss_mb(pid)
        try:
            stats = (await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {token}"})).json()
            sample |= {"sessions_in_memory": stats.get("sessions_in_memory"),
                       "active_kv_mb": stats["active_kv_bytes"] / 2**20,
                       "tier_mb": {t["name"]: round(t["usage_bytes"] / 2**20, 1) for t in stats["tiers"]}}
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            sample["admin_error"] = repr(exc)
        samples.append(sample)
        await asyncio.sleep(args.sample_seconds)


async def soak(service: ServiceProcess, token: str, args) -> tuple[list[dict], list[dict], float]:
    records, samples = [], []
    started = time.monotonic()
    stop_at = started + args.minutes * 60
    async with httpx.AsyncClient(base_url=service.url, timeout=600) as client:
        await asyncio.gather(sampler(client, service.process.pid, token, args, stop_at, samples),
                             *(user(client, i, args, stop_at, records) for i in range(args.users)))
    return records, samples, started


def windows(records: list[dict], samples: list[dict], started: float, minutes: float) -> list[dict]:
    rows, width = [], minutes * 60
    end = max([r["t"] for r in records] + [s["t"] for s in samples] + [started])
    begin = started
    while begin < end:
        turns = [r for r in records if begin <= r["t"] < begin + width]
        ttfts = [r["ttft_ms"] for r in turns if r.get("error") is None and r.get("round", 0) > 0]
        taken = [s for s in samples if begin <= s["t"] < begin + width]
        rows.append({
            "from_min": round((begin - started) / 60, 1),
            "turns": len(turns),
            "errors": sum(1 for r in turns if r.get("error")),
            "ttft_p50_ms": percentile(ttfts, 0.5),
            "ttft_p95_ms": percentile(ttfts, 0.95),
            "rss_mb_max": max((s["rss_mb"] for s in taken), default=None),
            "rss_mb_last": taken[-1]["rss_mb"] if taken else None,
            "anon_mb_max": max((s["anon_mb"] for s in taken), default=None),
            "file_mb_max": max((s["file_mb"] for s in taken), default=None),
            "sessions_in_memory_max": max((s.get("sessions_in_memory") or 0 for s in taken), default=None),
            "active_kv_mb_max": max((s.get("active_kv_mb") or 0 for s in taken), default=None),
        })
        begin += width
    return rows


def cell(value, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--rounds", type=int, default=4, help="user turns per session")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=2000, help="user messages are cut to this many characters")
    parser.add_argument("--idle-gap", type=float, default=15.0, help="seconds of idleness now and then")
    parser.add_argument("--idle-probability", type=float, default=0.2)
    parser.add_argument("--idle-offload", type=float, default=10.0, help="the service's idle offload (s)")
    parser.add_argument("--compress-after", type=float, default=30.0,
                        help="with --placement-policy lru: idle seconds before a stored blob is compressed")
    parser.add_argument("--placement-policy", default="value", choices=["value", "lru"],
                        help="the service's PLACEMENT_POLICY (value: the default; it decides compression itself)")
    parser.add_argument("--active-kv-budget-mb", type=int, default=100)
    parser.add_argument("--dram-budget-mb", type=int, default=256)
    parser.add_argument("--lmdb-budget-mb", type=int, default=1024)
    parser.add_argument("--max-idle-sessions", type=int, default=50)
    parser.add_argument("--sample-seconds", type=float, default=10)
    parser.add_argument("--window-minutes", type=float, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--json", help="write every turn and sample here")
    args = parser.parse_args()

    token = secrets.token_hex(16)
    env = {"STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache), "STATEKEEPER_ADMIN_TOKEN": token,
           "STATEKEEPER_ACTIVE_KV_BUDGET_MB": str(args.active_kv_budget_mb),
           "STATEKEEPER_DRAM_BUDGET_MB": str(args.dram_budget_mb), "STATEKEEPER_LMDB_BUDGET_MB": str(args.lmdb_budget_mb),
           "STATEKEEPER_IDLE_OFFLOAD_SECONDS": f"{args.idle_offload:g}",
           "STATEKEEPER_COMPRESS_AFTER_SECONDS": f"{args.compress_after:g}",
           "STATEKEEPER_PLACEMENT_POLICY": args.placement_policy,
           "STATEKEEPER_MAX_IDLE_SESSIONS": str(args.max_idle_sessions)}
    with tempfile.TemporaryDirectory(prefix="statekeeper-soak-") as root:
        service = ServiceProcess(Path(root), env)
        start_s = service.start()
        try:
            records, samples, started = asyncio.run(soak(service, token, args))
        finally:
            stop_s = service.stop()
    rows = windows(records, samples, started, args.window_minutes)
    rss = [s["rss_mb"] for s in samples]
    anon = [s["anon_mb"] for s in samples]
    print(f"machine: {machine_line()}; {args.users} users, {args.minutes:g} min, "
          f"active KV budget {args.active_kv_budget_mb} MB, DRAM tier {args.dram_budget_mb} MB, "
          f"max idle sessions {args.max_idle_sessions}; service start {start_s:.1f} s, stop {stop_s:.1f} s\n")
    print(markdown_table(["from min", "turns", "errors", "TTFT p50 ms", "TTFT p95 ms", "RSS max MB", "RSS last MB",
                          "anonymous max MB", "file-backed max MB", "sessions in memory (max)", "active KV MB (max)"],
                         [[row["from_min"], row["turns"], row["errors"], cell(row["ttft_p50_ms"]),
                           cell(row["ttft_p95_ms"]), cell(row["rss_mb_max"]), cell(row["rss_mb_last"]),
                           cell(row["anon_mb_max"]), cell(row["file_mb_max"]), cell(row["sessions_in_memory_max"]),
                           cell(row["active_kv_mb_max"], 1)] for row in rows]))
    sessions = sum(1 for r in records if r.get("round") == 0)
    errors = [r for r in records if r.get("error")]
    print(f"\nturns {len(records)}, sessions {sessions}, errors {len(errors)}; RSS MB first {rss[0]:.0f}, "
          f"median {statistics.median(rss):.0f}, max {max(rss):.0f}, last {rss[-1]:.0f}; anonymous MB first "
          f"{anon[0]:.0f}, median {statistics.median(anon):.0f}, max {max(anon):.0f}, last {anon[-1]:.0f}")
    for record in errors[:5]:
        print("error:", record.get("status"), record.get("error"))
    if args.json:
        write_json(args.json, {"args": vars(args) | {"model_cache": str(args.model_cache)}, "windows": rows,
                               "samples": samples, "turns": records})


if __name__ == "__main__":
    main()
