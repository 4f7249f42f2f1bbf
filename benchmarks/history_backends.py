"""What keeping the history in PostgreSQL (replicas) costs a turn next to LMDB (one process), side by side.

1. The store alone: a conversation grows turn by turn (--turns, --tokens-per-turn); each turn is what a
   replica over a shared history does: read the stored conversation (a turn starts from it) and commit
   the turn (compare-and-set on its turn count, with a fencing token). Milliseconds per turn, LMDB and
   PostgreSQL alternating.
2. Resumed turns through the session service (the model on the model thread, KV active in memory, policy
   none), one service per backend sharing one worker, the same conversation on each, alternating which
   goes first: time to the first token as a client sees it (lease-free: the read of the history happens
   before it), and the whole turn (the commit included).

PostgreSQL is a throwaway cluster on loopback with production durability (fsync, synchronous commit) unless
--dsn names one.

    python -m benchmarks.history_backends --threads 1 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.harness import add_model_arguments, load_worker, machine_record, percentile, write_json
from statekeeper.config import CompressionConfig, HistoryConfig, MiB, ServiceConfig, SessionConfig, TierConfig
from statekeeper.history import Conversation, LmdbHistory
from statekeeper.history.postgres import PostgresHistory
from statekeeper.assembly import build_service
from statekeeper.sessions import TurnDelta, TurnRequest
from benchmarks.harness.postgres_server import PostgresServer

USER_TURNS = ["Hello! Can you tell me about the history of Rome?", "What happened after the republic ended?",
              "Who was the first emperor?", "How long did the western empire last?", "Why did it fall?",
              "What about the eastern empire?", "Which city was its capital?", "Name three famous emperors.",
              "Which of them built walls?", "Thank you. Summarize everything in two sentences."]


def store_costs(stores: dict, turns: int, tokens_per_turn: int) -> dict[str, list[float]]:
    """Per turn, per store: ms to read the conversation and commit one more turn onto it."""
    costs = {name: [] for name in stores}
    for name, store in stores.items():
        store.save(Conversation(id=f"bench-{name}", created_at="now", system="Be brief."))
    for turn in range(turns):
        order = list(stores) if turn % 2 == 0 else list(reversed(stores))
        for name in order:
            store = stores[name]
            started = time.perf_counter()
            stored = store.load(f"bench-{name}")
            updated = dataclasses.replace(
                stored, messages=stored.messages + [{"role": "user", "content": f"question {turn} " * 20},
                                                    {"role": "assistant", "content": f"answer {turn} " * 40}],
                tokens=stored.tokens + list(range(turn, turn + tokens_per_turn)), updated_at="now")
            store.commit_turn(updated, stored.turns, fence=turn + 1)
            costs[name].append((time.perf_counter() - started) * 1000)
    return costs


async def service_turns(services: dict, rounds: int, max_tokens: int) -> dict[str, dict[str, list[float]]]:
    """Per resumed turn, per service: ms to the first token and for the whole turn, as a client sees them."""
    sessions = {name: (await service.create("Be brief.", None)).id for name, service in services.items()}
    timings = {name: {"first_token_ms": [], "turn_ms": []} for name in services}
    for turn in range(rounds):
        content = USER_TURNS[turn % len(USER_TURNS)]
        order = list(services) if turn % 2 == 0 else list(reversed(services))
        for name in order:
            started = time.perf_counter()
            first = None
            async for event in services[name].turn(sessions[name], TurnRequest(content, max_tokens=max_tokens)):
                if first is None and isinstance(event, TurnDelta):
                    first = time.perf_counter()
            if turn == 0:
                continue  # the first turn starts the conversation: only resumed turns count
            timings[name]["first_token_ms"].append((first - started) * 1000)
            timings[name]["turn_ms"].append((time.perf_counter() - started) * 1000)
    return timings


def summary(values: list[float]) -> dict:
    return {"p50": round(statistics.median(values), 3), "p95": round(percentile(values, 0.95), 3), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--dsn", help="a PostgreSQL database to use (else a throwaway cluster, durable)")
    parser.add_argument("--turns", type=int, default=200, help="store part: turns per conversation")
    parser.add_argument("--tokens-per-turn", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=21, help="service part: turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    server = None
    if args.dsn is None:
        server = PostgresServer(durable=True).start()
    try:
        with tempfile.TemporaryDirectory() as root:
            root = Path(root)
            dsn = args.dsn or server.create_database()
            stores = {"lmdb": LmdbHistory(root / "store.lmdb"), "postgres": PostgresHistory(dsn, pool_size=2)}
            costs = store_costs(stores, args.turns, args.tokens_per_turn)
            for store in stores.values():
                store.close()
            worker = load_worker(args)
            sessions = SessionConfig(compression=CompressionConfig(policy="none", codec="none"), compress_process=False)
            services = {
                backend: build_service(ServiceConfig(
                    data_dir=root / backend, sessions=sessions, tiers=[TierConfig("dram", 1024 * MiB)],
                    restore_planning=False,
                    history=HistoryConfig(backend, dsn if backend == "postgres" else None, pool_size=4)), worker)
                for backend in ("lmdb", "postgres")}
            try:
                timings = asyncio.run(service_turns(services, args.rounds, args.max_tokens))
            finally:
                for service in services.values():
                    service.close()
    finally:
        if server is not None:
            server.remove()
    report = {
        "machine": machine_record(),
        "args": vars(args) | {"dsn": "given" if args.dsn else "throwaway durable cluster"},
        "store_read_and_commit_ms": {name: summary(values) for name, values in costs.items()},
        "service": {name: {kind: summary(values) for kind, values in kinds.items()} for name, kinds in timings.items()},
    }
    lmdb, postgres = report["service"]["lmdb"], report["service"]["postgres"]
    report["postgres_minus_lmdb_ms"] = {
        kind: round(postgres[kind]["p50"] - lmdb[kind]["p50"], 3) for kind in ("first_token_ms", "turn_ms")}
    print(json.dumps(report, indent=2))
    if args.json:
        write_json(args.json, report, machine=report["machine"])


if __name__ == "__main__":
    main()
