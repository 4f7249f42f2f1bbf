"""Is the placement simulator right? The same day replayed through `statekeeper serve` and through the simulator
(issue 32): the synthetic trace (statekeeper/simulation/synthetic.py) with its time scaled down, its turns sent
by their users at their times (real ShareGPT user messages, replies of the trace's length up to --max-reply
tokens), with tight tier budgets, once per placement policy. The service writes its own trace of the run
(TRACE_FILE: the turns as they happened, with the tokens each added); the simulator then replays exactly that
trace with the same tiers and policy, and the two are compared: resumed turns by where their KV came from,
the hit rate (resumed turns that did not recompute) and the history tokens recomputed.

    python -m benchmarks.placement_live --conversations 240 --day-minutes 15 --json placement-live.json

Compression is off (lossless blobs) in both by default: what is validated is where blobs go and which leave, the
part the simulator runs as the service's own code. With --compression the service compresses with its default
(in its compression process, COMPRESS_AFTER_SECONDS scaled with the day) and the simulator with the cost
profile's CPU time a blob on one core: LRU on the schedule, the value policy by its own decisions. The service offloads an idle conversation at its sweep (every
second) after IDLE_OFFLOAD_SECONDS: the simulator offloads half a sweep later than that."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.harness import machine_line, markdown_table, write_json
from benchmarks.harness.model import MODEL_CACHE
from benchmarks.multiround import ServiceProcess
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.placement.trace import TraceTurn, read, tag
from statekeeper.simulation.command import DEFAULT_PROFILE, parse_profile
from statekeeper.simulation.simulator import RECOMPUTE, SimulationConfig, hit_rate, service_compression, simulate
from statekeeper.simulation.synthetic import SyntheticTrace, synthetic

MiB = 1 << 20
SWEEP_S = 1.0  # SessionConfig.sweep_interval_seconds


def user_messages(count: int, max_chars: int) -> list[str]:
    """ShareGPT's user messages in order, each cut to max_chars."""
    messages = []
    for conversation in sharegpt_conversations():
        messages += [content[:max_chars] for role, content in conversation if role == "user"]
        if len(messages) >= count:
            return messages[:count]
    raise ValueError(f"ShareGPT holds fewer than {count} user messages")


def scaled(turns: list[TraceTurn], scale: float) -> list[TraceTurn]:
    return [dataclasses.replace(turn, time_s=turn.time_s / scale) for turn in turns]


async def replay(url: str, turns: list[TraceTurn], messages: list[str], max_reply: int) -> list[dict]:
    """Each turn sent at its time (after the conversation's previous one has answered); returns, per turn in
    trace order, the session it went to and the reply's restore source."""
    results: list[dict] = [{} for _ in turns]
    sessions: dict[str, str] = {}
    last: dict[str, asyncio.Task] = {}

    async def one(client: httpx.AsyncClient, index: int, turn: TraceTurn, previous: asyncio.Task | None,
                  late: float) -> None:
        if previous is not None:
            await previous
        if turn.conversation not in sessions:
            response = await client.post("/v1/sessions", json={})
            response.raise_for_status()
            sessions[turn.conversation] = response.json()["id"]
        session = sessions[turn.conversation]
        response = await client.post(f"/v1/sessions/{session}/messages",
                                     json={"content": messages[index], "max_tokens": min(turn.reply_tokens, max_reply)})
        response.raise_for_status()
        body = response.json()
        results[index] = {"session": session, "source": body["restore"]["source"], "late_s": late}

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        tasks = []
        for index, turn in enumerate(turns):
            delay = turn.time_s - turns[0].time_s - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(one(client, index, turn, last.get(turn.conversation), max(0.0, -delay)))
            last[turn.conversation] = task
            tasks.append(task)
        await asyncio.gather(*tasks)
    return results


def live_counts(results: list[dict], trace: list[TraceTurn]) -> tuple[Counter, Counter]:
    """Resumed turns and their history tokens by restore source, the history read from the service's trace."""
    history, turns_by_source, tokens_by_source = Counter(), Counter(), Counter()
    by_conversation: dict[str, list[TraceTurn]] = {}
    for turn in trace:
        by_conversation.setdefault(turn.conversation, []).append(turn)
    seen: Counter = Counter()
    for result in results:
        conversation = tag(result["session"])
        index = seen[conversation]
        seen[conversation] += 1
        if index:
            turns_by_source[result["source"]] += 1
            tokens_by_source[result["source"]] += history[conversation]
        written = by_conversation[conversation][index]
        history[conversation] += written.prompt_tokens + written.reply_tokens
    return turns_by_source, tokens_by_source


def agreement(results: list[dict], written: list[TraceTurn], simulated_sources: list[str]) -> dict:
    """Turn by turn, whether the simulator found the KV where the service did: the same source, and the
    same hit or miss (recompute or not), over the resumed turns."""
    simulated, seen = {}, Counter()
    for turn, source in zip(sorted(written, key=lambda turn: turn.time_s), simulated_sources):
        simulated[(turn.conversation, seen[turn.conversation])] = source
        seen[turn.conversation] += 1
    live, seen = {}, Counter()
    for result in results:
        conversation = tag(result["session"])
        live[(conversation, seen[conversation])] = result["source"]
        seen[conversation] += 1
    resumed = [key for key in live if key[1] > 0]
    same = sum(live[key] == simulated.get(key) for key in resumed)
    same_hit = sum((live[key] == RECOMPUTE) == (simulated.get(key) == RECOMPUTE) for key in resumed)
    return {"resumed": len(resumed), "same_source": same / max(1, len(resumed)),
            "same_hit_or_miss": same_hit / max(1, len(resumed))}


def summary(turns: Counter, tokens: Counter) -> dict:
    resumed = sum(turns.values())
    return {"resumed": dict(turns), "hit_rate": hit_rate(turns) if resumed else 1.0,
            "recomputed_tokens": tokens[RECOMPUTE], "history_tokens": dict(tokens)}


def run_policy(policy: str, trace: list[TraceTurn], messages: list[str], args, directory: Path) -> dict:
    data_dir, trace_file = directory / policy, directory / f"{policy}-trace.jsonl"
    lossless = {} if args.compression else {"STATEKEEPER_COMPRESSION_POLICY": "none",
                                            "STATEKEEPER_COMPRESSION_CODEC": "none"}
    env = {"STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache), "STATEKEEPER_PLACEMENT_POLICY": policy,
           "STATEKEEPER_TRACE_FILE": str(trace_file), **lossless,
           "STATEKEEPER_COMPRESS_AFTER_SECONDS": f"{args.compress_after / args.scale:g}",
           "STATEKEEPER_DRAM_BUDGET_MB": str(args.dram_mb),
           "STATEKEEPER_LMDB_BUDGET_MB": str(args.lmdb_mb),
           "STATEKEEPER_IDLE_OFFLOAD_SECONDS": f"{args.idle_offload / args.scale:g}",
           "STATEKEEPER_ACTIVE_KV_BUDGET_MB": str(args.active_kv_mb)}
    data_dir.mkdir(parents=True)
    service = ServiceProcess(data_dir, env)
    service.start()
    try:
        started = time.perf_counter()
        results = asyncio.run(replay(service.url, trace, messages, args.max_reply))
        wall_s = time.perf_counter() - started
        stored = next((view for view in (httpx.get(f"{service.url}/v1/sessions/{r['session']}", timeout=30).json()
                                         for r in results[::-1])
                       if view.get("stored_bytes") and not view.get("is_compressed")), None)
    finally:
        service.stop()
    # An exact blob's bytes a token, header included (the profile's if none is left exact)
    bytes_per_token = (round(stored["stored_bytes"] / stored["tokens"]) if stored is not None
                       else args.profile.bytes_per_token)
    written = list(read(trace_file))
    if args.keep_traces:
        args.keep_traces.mkdir(parents=True, exist_ok=True)
        shutil.copy(trace_file, args.keep_traces / trace_file.name)
        (args.keep_traces / f"{policy}-live-sources.json").write_text(json.dumps(results))
    live_turns, live_tokens = live_counts(results, written)
    profile = dataclasses.replace(args.profile, bytes_per_token=bytes_per_token)
    compression = service_compression(policy, lossless=not args.compression)
    config = SimulationConfig([("dram", args.dram_mb * MiB), ("lmdb", args.lmdb_mb * MiB)], profile.with_workers(1),
                              args.idle_offload / args.scale + SWEEP_S / 2, policy, compression,
                              args.compress_after / args.scale, record_turns=True)
    report = simulate(written, config)
    return {"policy": policy, "wall_s": round(wall_s, 1), "turns": len(results), "bytes_per_token": bytes_per_token,
            "late_s_max": round(max(r["late_s"] for r in results), 1),
            "live": summary(live_turns, live_tokens), "simulated": summary(report.resumed, report.history_tokens),
            "agreement": agreement(results, written, report.turn_sources)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=240)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--day-minutes", type=float, default=15.0, help="the day's 24 hours replayed in this long")
    parser.add_argument("--idle-offload", type=float, default=300.0, help="in the trace's seconds (scaled)")
    parser.add_argument("--compress-after", type=float, default=600.0, help="in the trace's seconds (scaled)")
    parser.add_argument("--compression", action="store_true", help="the service's default compression on")
    parser.add_argument("--dram-mb", type=int, default=16)
    parser.add_argument("--lmdb-mb", type=int, default=48)
    parser.add_argument("--active-kv-mb", type=int, default=2048)
    parser.add_argument("--max-reply", type=int, default=16)
    parser.add_argument("--max-message-chars", type=int, default=1200)
    parser.add_argument("--policies", default="lru,value")
    parser.add_argument("--profile", type=parse_profile, default=str(DEFAULT_PROFILE))
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--keep-traces", type=Path, help="copy the service's traces (and the replay's sources) here")
    parser.add_argument("--json")
    args = parser.parse_args()
    args.scale = 86_400 / (args.day_minutes * 60)
    print(machine_line(), flush=True)
    trace = scaled(synthetic(SyntheticTrace(args.conversations, tenants=args.tenants, seed=args.seed)), args.scale)
    messages = user_messages(len(trace), args.max_message_chars)
    rows = []
    with tempfile.TemporaryDirectory(prefix="placement-live-") as directory:
        for policy in args.policies.split(","):
            rows.append(run_policy(policy, trace, messages, args, Path(directory)))
            print(rows[-1], flush=True)
    table = []
    for row in rows:
        live, sim = row["live"], row["simulated"]
        for source in sorted(set(live["resumed"]) | set(sim["resumed"])):
            table.append([row["policy"], source, live["resumed"].get(source, 0), sim["resumed"].get(source, 0), "", ""])
        table.append([row["policy"], "**hit rate / recomputed tokens**", f"{live['hit_rate']:.3f}",
                      f"{sim['hit_rate']:.3f}", f"{sim['hit_rate'] / live['hit_rate']:.3f}",
                      f"{live['recomputed_tokens']:,} / {sim['recomputed_tokens']:,} "
                      f"({sim['recomputed_tokens'] / max(1, live['recomputed_tokens']):.3f})"])
        table.append([row["policy"], "turn by turn: same source / same hit or miss",
                      f"{row['agreement']['same_source']:.3f}", f"{row['agreement']['same_hit_or_miss']:.3f}", "", ""])
    print(markdown_table(["policy", "resumed from", "live", "simulated", "hit rate sim ÷ live",
                          "recomputed tokens live / sim (÷)"], table))
    if args.json:
        write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k != "profile"}, "rows": rows})


if __name__ == "__main__":
    main()
