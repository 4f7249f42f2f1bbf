"""Issue 18's two replica benchmarks, `statekeeper serve` processes over one PostgreSQL history and one Redis
(a throwaway PostgreSQL cluster with production durability and a redis-server, both on loopback).

    flock /tmp/statekeeper-quiet python -m benchmarks.replicas --part restore --json replicas-restore.json
    flock /tmp/statekeeper-quiet python -m benchmarks.replicas --part throughput --users 8 --json throughput.json
    (and again with --configs 2x1-rr,2x1-sticky,1x2,1x1: the same set in reverse order)

Both parts replay real ShareGPT conversations, as benchmarks/multiround.py picks them (user i replays the
first --rounds user messages of its own conversation, each cut to --max-chars), greedy, --max-tokens per
reply, lossless (COMPRESSION_POLICY=none, so every setup computes the same replies and histories) and with
restore planning off (RESTORE_PLANNING=false: a stored state is always loaded from its tier, never
recomputed by choice), as tests/e2e/test_replicas.py runs replicas.

1. --part restore: where a resumed turn's KV comes from, the same conversations side by side, one turn at a
   time (nothing else runs). Every setup replays every conversation; after each turn the conversation is
   offloaded (POST /offload, not timed, its ms recorded) and the next turn restores it:
       redis-other  replicas A and B (PostgreSQL history, leases and the shared KV tier in Redis): turns
                    alternate A, B, A, ...; each offload goes to Redis, so each resumed turn is restored
                    from the shared tier by the replica that did not store it
       redis-same   the same pair, every turn on A: restored from Redis by the replica that stored it
       dram, lmdb   a replica on its own (PostgreSQL history, no Redis): offload goes to its fastest tier
                    with room, DRAM, or LMDB where DRAM is off (DRAM_ENABLED=false)
       recompute    a replica on its own that keeps no state (a 1 MB DRAM tier no blob fits, no LMDB):
                    the KV is prefilled again from the history, what a replica gets without the shared tier
       active       no offload: the KV is still in the worker (the floor)
   Every setup reads its history from the same PostgreSQL cluster (its own database), so only the KV's
   source differs. Turns go round by round, conversation by conversation, and the order of the setups
   rotates with every turn. TTFT is the client's (request to the first streamed token); restore ms is
   the service's. Only resumed turns count.
2. --part throughput: aggregate turns/s of 1 against 2 replicas, --users concurrent users (one asyncio task
   each, think time 0.5-2 s before every turn, as multiround's schedule without idle gaps). Configurations
   (fresh replicas, a fresh database and Redis each; the same seeded schedule):
       1x1          one replica, TORCH_THREADS=1 (the service's default)
       1x2          one replica, TORCH_THREADS=2 (the whole machine's cores to one process)
       2x1-sticky   two replicas, TORCH_THREADS=1 each; user i always talks to replica i % 2
       2x1-rr       two replicas, TORCH_THREADS=1 each; every request (session create and turn) goes to the
                    next replica in turn, one counter for all users (docker/nginx/scale.conf's round robin
                    before it hashed by conversation)
       2x1-proxy    two replicas, TORCH_THREADS=1 each, behind a real nginx running docker/nginx/scale.conf
                    (benchmarks/harness/nginx_server.py: only the upstream addresses and the listen port replaced):
                    every request goes to the proxy, which sends each conversation to one replica by
                    consistent hashing on its session id (which replica, from nginx's access log)
   Turns/s is completed turns over the wall time of the whole replay (think time included)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import redis

from benchmarks.multiround import Turn, build_schedule, cell, pick_users, send_turn
from benchmarks.harness import MODEL_CACHE, markdown_table, percentile, write_json
from benchmarks.harness.nginx_server import NginxProxy
from benchmarks.harness.postgres_server import PostgresServer
from benchmarks.harness.redis_server import RedisServer
from benchmarks.harness.replica_server import ReplicaServer, start_all

RESTORE_SETUPS = ("redis-other", "redis-same", "dram", "lmdb", "recompute", "active")
THROUGHPUT_CONFIGS = {  # name: (replicas, torch threads each, routing)
    "1x1": (1, 1, "one"), "1x2": (1, 2, "one"), "2x1-sticky": (2, 1, "sticky"), "2x1-rr": (2, 1, "round-robin"),
    "2x1-proxy": (2, 1, "proxy")}


# -- replicas ----------------------------------------------------------------------------------------


def base_settings(args, admin_token: str, threads: int) -> dict:
    return {
        "MODEL": args.model, "MODEL_CACHE_DIR": str(args.model_cache), "DEVICE": "cpu", "TORCH_THREADS": threads,
        "COMPRESSION_POLICY": "none", "COMPRESSION_CODEC": "none", "COMPRESS_PROCESS": "false",
        "RESTORE_PLANNING": "false", "ADMIN_TOKEN": admin_token,
        "BLOB_SECRET": "bench-replica-blob-secret-0123456789abcdef",
        "INDEX_SECRET": "bench-replica-index-secret-0123456789abcdef",
    }


def replica_settings(base: dict, dsn: str, redis_url: str, prefix: str) -> dict:
    """A replica of a multi-replica deployment: the shared history, leases and the shared KV tier."""
    return base | {"HISTORY_BACKEND": "postgres", "POSTGRES_DSN": dsn, "LEASE_REDIS_URL": redis_url,
                   "REDIS_ENABLED": "true", "REDIS_URL": redis_url, "REDIS_KEY_PREFIX": prefix}


def local_settings(base: dict, dsn: str, **tiers) -> dict:
    """A replica on its own over a PostgreSQL history: no Redis, offload goes to its own tiers."""
    return base | {"HISTORY_BACKEND": "postgres", "POSTGRES_DSN": dsn} | tiers


def stop_all(servers: list[ReplicaServer]) -> None:
    for server in servers:
        server.stop()


async def admin_tiers(client: httpx.AsyncClient, admin_token: str) -> dict:
    response = await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})
    return response.json() if response.status_code == 200 else {"status": response.status_code}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}


# -- part 1: restore sources -------------------------------------------------------------------------


async def replay_restores(users: list[list[str]], urls: dict[str, str], args) -> list[dict]:
    """Every setup replays every conversation, one turn at a time; returns one record per turn."""
    clients = {name: httpx.AsyncClient(base_url=url, timeout=600) for name, url in urls.items()}
    # setup -> (replica of turn `round`, offload after each turn)
    plan = {
        "redis-other": (lambda r: ("a", "b")[r % 2], True),
        "redis-same": (lambda r: "a", True),
        "dram": (lambda r: "dram", True),
        "lmdb": (lambda r: "lmdb", True),
        "recompute": (lambda r: "none", True),
        "active": (lambda r: "dram", False),
    }
    setups = [name for name in RESTORE_SETUPS if name in args.setups]
    records = []
    try:
        sessions = {}
        for setup in setups:
            for user in range(len(users)):
                response = await clients[plan[setup][0](0)].post("/v1/sessions", json={"system": None})
                response.raise_for_status()
                sessions[setup, user] = response.json()["id"]
        rotation = itertools.count()
        for round_index in range(args.rounds):
            for user, messages in enumerate(users):
                shift = next(rotation) % len(setups)
                for setup in setups[shift:] + setups[:shift]:
                    replica, offloads = plan[setup]
                    client = clients[replica(round_index)]
                    turn = Turn(user, round_index, messages[round_index], 0.0, 0.0)
                    record = await send_turn(client, sessions[setup, user], turn, args.max_tokens)
                    record |= {"setup": setup, "replica": replica(round_index)}
                    if offloads:
                        started = time.perf_counter()
                        response = await client.post(f"/v1/sessions/{sessions[setup, user]}/offload")
                        record["offload_ms"] = (time.perf_counter() - started) * 1000
                        record["offload_status"] = response.status_code
                    records.append(record)
                    if record["error"]:
                        print(f"error: {setup} user {user} round {round_index}: {record['error']}", flush=True)
            print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return records


def restore_report(records: list[dict]) -> dict:
    report = {}
    for setup in RESTORE_SETUPS:
        mine = [r for r in records if r["setup"] == setup]
        if not mine:
            continue
        resumed = [r for r in mine if r["error"] is None and r["round"] > 0]
        sources = {}
        for r in resumed:
            sources[r["source"]] = sources.get(r["source"], 0) + 1
        offloads = [r["offload_ms"] for r in mine if r.get("offload_ms") is not None]
        report[setup] = {
            "resumed_turns": len(resumed),
            "errors": sum(r["error"] is not None for r in mine),
            "sources": sources,
            "ttft_ms": summary([r["ttft_ms"] for r in resumed]),
            "server_ttft_ms": summary([r["server_ttft_ms"] for r in resumed]),
            "restore_ms": summary([r["restore_ms"] for r in resumed]),
            "offload_ms": summary(offloads) if offloads else None,
            "cached_tokens": summary([r["cached_tokens"] for r in resumed]),
            "prompt_tokens": summary([r["prompt_tokens"] for r in resumed]),
        }
    # The same turn of the same conversation, setup against setup: the per-turn difference.
    by_turn = {(r["setup"], r["user"], r["round"]): r for r in records if r["error"] is None and r["round"] > 0}
    paired = {}
    for setup, of in (("redis-other", "dram"), ("redis-other", "lmdb"), ("redis-other", "redis-same"),
                      ("redis-other", "recompute"), ("redis-other", "active"), ("dram", "active")):
        keys = [(u, r) for (s, u, r) in by_turn if s == setup and (of, u, r) in by_turn]
        if keys:
            paired[f"{setup} - {of}"] = {
                kind: summary([by_turn[setup, u, r][kind] - by_turn[of, u, r][kind] for u, r in keys])
                for kind in ("ttft_ms", "restore_ms")}
    return {"setups": report, "paired_differences_ms": paired}


def restore_table(report: dict) -> str:
    setups = report["setups"]
    names = list(setups)
    rows = [
        ("resumed turns (errors)", lambda s: f"{s['resumed_turns']} ({s['errors']})"),
        ("restore source (turns)", lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["sources"].items()))),
        ("TTFT p50 ms", lambda s: cell(s["ttft_ms"]["p50"], 0)),
        ("TTFT p95 ms", lambda s: cell(s["ttft_ms"]["p95"], 0)),
        ("restore p50 ms", lambda s: cell(s["restore_ms"]["p50"], 1)),
        ("restore p95 ms", lambda s: cell(s["restore_ms"]["p95"], 1)),
        ("restored tokens p50 / p95", lambda s: f"{cell(s['cached_tokens']['p50'], 0)} / "
                                                 f"{cell(s['cached_tokens']['p95'], 0)}"),
        ("offload p50 ms (not in TTFT)", lambda s: cell(s["offload_ms"]["p50"], 1) if s["offload_ms"] else "—"),
    ]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(fn(setups[n]) for n in names) + " |" for label, fn in rows]
    lines += ["", markdown_table(
        ["same turn, setup − setup", "TTFT p50 ms", "TTFT p95 ms", "restore p50 ms", "restore p95 ms", "turns"],
        [[pair, cell(kinds["ttft_ms"]["p50"], 0), cell(kinds["ttft_ms"]["p95"], 0), cell(kinds["restore_ms"]["p50"], 1),
          cell(kinds["restore_ms"]["p95"], 1), kinds["ttft_ms"]["n"]]
         for pair, kinds in report["paired_differences_ms"].items()])]
    return "\n".join(lines)


def run_restore(args, users, postgres: PostgresServer, redis_server: RedisServer, root: Path) -> dict:
    admin_token = secrets.token_hex(16)
    base = base_settings(args, admin_token, threads=args.threads)
    pair_dsn = postgres.create_database()
    shared = replica_settings(base, pair_dsn, redis_server.url, "restore:")
    servers = {"a": ReplicaServer(root / "a", shared), "b": ReplicaServer(root / "b", shared),
               "dram": ReplicaServer(root / "dram", local_settings(base, postgres.create_database())),
               "lmdb": ReplicaServer(root / "lmdb", local_settings(base, postgres.create_database(),
                                                                    DRAM_ENABLED="false")),
               "none": ReplicaServer(root / "none", local_settings(base, postgres.create_database(),
                                                                    DRAM_BUDGET_MB=1, LMDB_ENABLED="false"))}
    start_all(list(servers.values()))
    try:
        records = asyncio.run(replay_restores(users, {name: s.url for name, s in servers.items()}, args))
    finally:
        stop_all(list(servers.values()))
    return {"turns": records} | restore_report(records)


# -- part 2: 1 vs 2 replicas -------------------------------------------------------------------------


async def replay_throughput(urls: list[str], schedule: list[list[Turn]], routing: str, args,
                            admin_token: str, proxy: NginxProxy | None = None) -> dict:
    """With `proxy` (routing "proxy") every request goes to it, and which replica served each turn is read
    from its access log afterwards."""
    clients = [httpx.AsyncClient(base_url=url, timeout=600) for url in urls]
    via_proxy = httpx.AsyncClient(base_url=proxy.url, timeout=600) if proxy else None
    counter = itertools.count()

    def route(user: int) -> int:
        if routing == "proxy":
            return -1  # nginx decides
        if routing == "sticky":
            return user % len(clients)
        if routing == "round-robin":
            return next(counter) % len(clients)
        return 0

    async def user_task(turns: list[Turn]) -> list[dict]:
        replica = route(turns[0].user)
        client = via_proxy or clients[replica]
        response = await client.post("/v1/sessions", json={"system": None})
        if response.status_code != 201:
            return [{"user": turns[0].user, "round": -1, "status": response.status_code, "error": response.text[:300]}]
        session_id, records, previous = response.json()["id"], [], replica
        for turn in turns:
            await asyncio.sleep(turn.wait_s)
            replica = route(turn.user)
            record = await send_turn(via_proxy or clients[replica], session_id, turn, args.max_tokens)
            records.append(record | {"session": session_id, "replica": replica, "moved": replica != previous})
            previous = replica
        return records

    try:
        started = time.perf_counter()
        per_user = await asyncio.gather(*(user_task(turns) for turns in schedule))
        wall_s = time.perf_counter() - started
        admin = [await admin_tiers(client, admin_token) for client in clients]
    finally:
        for client in clients + ([via_proxy] if via_proxy else []):
            await client.aclose()
    turns = [r for records in per_user for r in records]
    if proxy:
        attribute_replicas(turns, proxy, urls)
    return {"wall_s": wall_s, "turns": turns, "replicas": len(urls),
            "model_thread": [a.get("model_thread") for a in admin]}


def attribute_replicas(turns: list[dict], proxy: NginxProxy, urls: list[str]) -> None:
    """Each turn's replica from nginx's access log: a session's turns run one after the other, so its
    n-th logged POST .../messages is its n-th turn. `moved`: not on the replica of its previous turn."""
    ports = [url.rsplit(":", 1)[1] for url in urls]
    served: dict[str, list[int]] = {}
    for method, uri, upstream, _ in proxy.requests():
        if method == "POST" and uri.startswith("/v1/sessions/") and uri.endswith("/messages"):
            served.setdefault(uri.split("/")[3], []).append(ports.index(upstream.rsplit(":", 1)[1]))
    by_session: dict[str, list[dict]] = {}
    for turn in turns:
        if "session" in turn:
            by_session.setdefault(turn["session"], []).append(turn)
    for session, mine in by_session.items():
        replicas = served.get(session, [])
        if len(replicas) != len(mine):  # a turn that never reached a replica: say so, attribute none
            print(f"warning: {session}: {len(mine)} turns, {len(replicas)} in nginx's log", flush=True)
            for turn in mine:
                turn["replica"], turn["moved"] = None, False
            continue
        previous = None
        for turn, replica in zip(sorted(mine, key=lambda t: t["round"]), replicas):
            turn["replica"], turn["moved"] = replica, previous is not None and replica != previous
            previous = replica


def throughput_summary(name: str, run: dict) -> dict:
    done = [t for t in run["turns"] if t["error"] is None]
    resumed = [t for t in done if t["source"] != "first"]
    sources = {}
    for t in resumed:
        sources[t["source"]] = sources.get(t["source"], 0) + 1
    return {
        "config": name,
        "wall_s": run["wall_s"],
        "turns": len(done),
        "errors": len(run["turns"]) - len(done),
        "first_errors": [{k: t.get(k) for k in ("user", "round", "status", "error")}
                         for t in run["turns"] if t["error"] is not None][:3],
        "turns_per_s": len(done) / run["wall_s"],
        "completion_tokens_per_s": sum(t["completion_tokens"] for t in done) / run["wall_s"],
        "ttft_ms": summary([t["ttft_ms"] for t in resumed]),
        "latency_ms": summary([t["latency_ms"] for t in done]),
        "resumed_sources": sources,
        "moved_turns": sum(bool(t.get("moved")) for t in resumed),
        "turns_per_replica": [sum(t["replica"] == i for t in done) for i in range(run["replicas"])],
        "model_thread_live_s": [(m or {}).get("live_seconds") for m in run["model_thread"]],
    }


def throughput_table(repeats: list[list[dict]]) -> str:
    names = [s["config"] + (f" #{i + 1}" if len(repeats) > 1 else "") for i, rep in enumerate(repeats) for s in rep]
    columns = [s for rep in repeats for s in rep]
    rows = [
        ("turns (errors)", lambda s: f"{s['turns']} ({s['errors']})"),
        ("wall time s", lambda s: cell(s["wall_s"], 1)),
        ("turns/s", lambda s: cell(s["turns_per_s"], 3)),
        ("reply tokens/s", lambda s: cell(s["completion_tokens_per_s"], 2)),
        ("resumed TTFT p50 ms", lambda s: cell(s["ttft_ms"]["p50"], 0)),
        ("resumed TTFT p95 ms", lambda s: cell(s["ttft_ms"]["p95"], 0)),
        ("turn latency p50 ms", lambda s: cell(s["latency_ms"]["p50"], 0)),
        ("resumed turns by restore source",
         lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["resumed_sources"].items()))),
        ("resumed turns on another replica than the last", lambda s: str(s["moved_turns"])),
        ("turns per replica", lambda s: " / ".join(map(str, s["turns_per_replica"]))),
        ("model thread live s per replica", lambda s: " / ".join(cell(v, 1) for v in s["model_thread_live_s"])),
    ]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(fn(s) for s in columns) + " |" for label, fn in rows]
    ratios = []
    for i, rep in enumerate(repeats):
        rate = {s["config"]: s["turns_per_s"] for s in rep}
        for name in rate:
            for of in ("1x1", "1x2"):
                if name.startswith("2x") and of in rate:
                    ratios.append(f"repeat {i + 1}: {name} / {of} turns/s = {rate[name] / rate[of]:.3f}")
    return "\n".join(lines + [""] + ratios)


def run_throughput(args, schedule, postgres: PostgresServer, redis_server: RedisServer,
                   root: Path) -> tuple[list[list[dict]], list[dict]]:
    repeats, runs = [], []
    flush = redis.Redis.from_url(redis_server.url)
    for repeat in range(args.repeats):
        order = args.configs if repeat % 2 == 0 else args.configs[::-1]
        summaries = []
        for name in order:
            count, threads, routing = THROUGHPUT_CONFIGS[name]
            flush.flushdb()
            admin_token = secrets.token_hex(16)
            settings = replica_settings(base_settings(args, admin_token, threads), postgres.create_database(),
                                        redis_server.url, f"{name}-{repeat}:")
            servers = start_all([ReplicaServer(root / f"{name}-{repeat}-{i}", settings) for i in range(count)])
            proxy = None
            try:
                if routing == "proxy":
                    upstreams = [f"127.0.0.1:{s.port}" for s in servers]
                    proxy = NginxProxy(root / f"{name}-{repeat}-nginx", upstreams).start()
                run = asyncio.run(replay_throughput([s.url for s in servers], schedule, routing, args, admin_token,
                                                    proxy))
            finally:
                if proxy:
                    proxy.stop()
                stop_all(servers)
            runs.append({"config": name, "repeat": repeat} | run)
            summaries.append(throughput_summary(name, run))
            s = summaries[-1]
            print(json.dumps({"config": name, "repeat": repeat, "wall_s": round(s["wall_s"], 2),
                              "turns_per_s": round(s["turns_per_s"], 3), "errors": s["errors"],
                              "ttft_p50_ms": s["ttft_ms"]["p50"], "sources": s["resumed_sources"]}), flush=True)
        repeats.append(sorted(summaries, key=lambda s: args.configs.index(s["config"])))
    return repeats, runs


# -- main --------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("restore", "throughput", "both"), default="both")
    parser.add_argument("--model", default="smollm2", help="smollm2 or a local Hugging Face model directory")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--users", type=int, default=6, help="conversations (restore) / concurrent users (throughput)")
    parser.add_argument("--rounds", type=int, default=5, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=4000, help="user messages are cut to this many characters")
    parser.add_argument("--min-user-chars", type=int, default=3000,
                        help="pick conversations whose first --rounds user messages hold this many characters")
    parser.add_argument("--seed", type=int, default=0, help="think times")
    parser.add_argument("--threads", type=int, default=1, help="restore part: TORCH_THREADS of every replica")
    parser.add_argument("--setups", default=",".join(RESTORE_SETUPS), type=lambda v: v.split(","),
                        help="restore part: which setups, of " + ",".join(RESTORE_SETUPS))
    parser.add_argument("--configs", default=",".join(THROUGHPUT_CONFIGS), type=lambda v: v.split(","),
                        help="throughput part: run in this order, of " + ",".join(THROUGHPUT_CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="throughput part: the set again, in reverse order")
    parser.add_argument("--json", help="write the report and every turn here")
    args = parser.parse_args()
    if set(args.setups) - set(RESTORE_SETUPS) or set(args.configs) - set(THROUGHPUT_CONFIGS):
        parser.error("unknown setup or config")

    users = pick_users(args.users, args.rounds, args.min_user_chars, args.max_chars)
    report = {
        "args": vars(args) | {"model_cache": str(args.model_cache)},
    }
    postgres = PostgresServer(durable=True).start()
    try:
        with tempfile.TemporaryDirectory(prefix="statekeeper-replicas-") as root:
            root = Path(root)
            redis_server = RedisServer(root / "redis").start()
            try:
                if args.part in ("restore", "both"):
                    report["restore"] = run_restore(args, users, postgres, redis_server, root / "restore")
                    print("\n" + restore_table(report["restore"]) + "\n", flush=True)
                if args.part in ("throughput", "both"):
                    schedule = build_schedule(users, [0.0], 1.0, args.seed)
                    repeats, runs = run_throughput(args, schedule, postgres, redis_server, root / "throughput")
                    report["throughput"] = {"summaries": repeats, "runs": runs,
                                            "schedule": [[t.wait_s for t in turns] for turns in schedule]}
                    print("\n" + throughput_table(repeats) + "\n", flush=True)
            finally:
                redis_server.stop()
    finally:
        postgres.remove()
    if args.json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
