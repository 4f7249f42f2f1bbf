"""Resumed-turn TTFT: hot vs restored from DRAM vs restored from LMDB vs full recompute, side by side.

Replays real ShareGPT conversations (real user messages; the model's own replies, capped at 64 tokens)
through the session service. Before every resumed turn whose history has >= --min-history tokens, the
same turn is timed (first token only) on probe sessions that share the history: one hot (KV cloned in
memory), one whose KV blob sits in DRAM, one in LMDB (page cache warm), one with no KV (recompute). The
order of the probes rotates from round to round; each mode's TTFT is the median of --rounds samples. A plain-transformers reference runs at the same points:
DynamicCache in fp16 written with torch.save and read back (page cache warm), against its own hot path.
With --compressed TIERS, probes also restore the service's default compression from those tiers: per
measured turn the stored state is compressed once as the service does (offload, then its background
compression), and each probe reads that blob (restored layer by layer behind the prompt's prefill). With
--exact-copy TIER those tiers are probed once more with the exact state kept in TIER as well (EXACT_COPY_TIER,
issue 33): the restore takes the exact state from there whole instead of decoding the blob.

    python -m benchmarks.restore_ttft --threads 1 --conversations 20 --json out.json
    python -m benchmarks.restore_ttft --threads 1 --compressed dram,lmdb --min-history 1500
    python -m benchmarks.restore_ttft --threads 1 --tiers dram,ssd --compressed dram --exact-copy ssd
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

import torch

from benchmarks.harness import add_model_arguments, load_worker, machine_line, markdown_table, write_json
from statekeeper.config import CompressionConfig, MiB, ServiceConfig, SessionConfig, TierConfig
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.kv_cache import KVCache
from statekeeper.assembly import build_service
from statekeeper.sessions import LiveSession, TurnRequest
from statekeeper.sessions.exact_copy import copy_key
from statekeeper.worker import ModelWorker
from storage import serialization

STORED = ["dram", "lmdb", "ssd", "redis"]
COMPRESSED = "-compressed"  # mode suffix: the default compression's blob in that tier
WITH_COPY = "+copy"  # ... and the exact state in --exact-copy's tier, which the restore takes whole
DEFAULT_COMPRESSION = dataclasses.asdict(CompressionConfig())
REPLY_TOKENS = 64
CONTEXT_RESERVE = 1024


def pick_conversations(count: int, min_user_chars: int = 3000, window: int = 4) -> list[list[str]]:
    """The first `count` ShareGPT conversations with >= 4 user turns whose first `window` user messages
    hold >= `min_user_chars` characters (so that resumed turns reach long histories)."""
    picked = []
    for conversation in sharegpt_conversations(min_turns=4):
        users = [content for role, content in conversation if role == "user"]
        if max(len(u) for u in users) <= 6000 and sum(len(u) for u in users[:window]) >= min_user_chars:
            picked.append(users)
        if len(picked) == count:
            return picked
    return picked


async def first_token(service, session_id: str, content: str):
    async for event in service.turn(session_id, TurnRequest(content, max_tokens=1)):
        result = event
    return result


async def copy_of(service, main: LiveSession, mode: str, compression: dict | None = None) -> LiveSession:
    """A copy of `main`'s conversation under another id, held by the service (without KV yet)."""
    name = mode.replace("+", "-")  # ids are [A-Za-z0-9_-]
    conversation = dataclasses.replace(main.conversation, id=f"probe-{name}-{time.time_ns()}", compression=compression)
    service.history.save(conversation)
    return await service.get_live(conversation.id, tenant=None)


async def compressed_blob(service, main: LiveSession) -> bytes:
    """`main`'s state stored and compressed with the default compression, as the service does it."""
    live = await copy_of(service, main, "template", DEFAULT_COMPRESSION)
    live.cache = KVCache.from_layers(main.cache.export_layers(), service.worker.device)
    await service.offload(live.id)
    await service.compress_due()
    view = await service.view(live.id)
    assert view.is_compressed, view
    blob = bytes(service.tiers.tier(view.tier).get(live.id))
    await service.delete(live.id)
    return blob


async def probe(service, main: LiveSession, mode: str, content: str, compressed: bytes | None = None):
    """Times the first token of `content` on a copy of `main` whose KV is hot, in a tier (as it is, or
    as the `compressed` blob), or absent."""
    tier = mode.removesuffix(WITH_COPY).removesuffix(COMPRESSED)
    is_compressed = mode.removesuffix(WITH_COPY).endswith(COMPRESSED)
    live = await copy_of(service, main, mode, DEFAULT_COMPRESSION if is_compressed else None)
    if mode == "hot":
        live.cache = KVCache.from_layers(main.cache.export_layers(), service.worker.device)
    elif is_compressed:
        assert service.tiers.put(live.id, compressed, tier=tier) == tier
        if mode.endswith(WITH_COPY):
            exact = serialization.encode(main.cache.export_layers(), service.worker.fingerprint,
                                         live.conversation.tokens)
            copy_tier = service.config.exact_copy_tier
            assert service.tiers.put(copy_key(live.id), exact, tier=copy_tier) == copy_tier
    elif mode in STORED:
        blob = serialization.encode(main.cache.export_layers(), service.worker.fingerprint, live.conversation.tokens)
        assert service.tiers.put(live.id, blob, tier=mode) == mode
    copy_restores = service.loader.copies.restores
    result = await first_token(service, live.id, content)
    assert result.restore_source == tier if mode != "hot" else result.restore_source == "active"
    assert service.loader.copies.restores == copy_restores + mode.endswith(WITH_COPY)  # read the copy, or none
    await service.delete(live.id)
    return result


def compressed_modes(args) -> list[str]:
    modes = [t + COMPRESSED for t in args.compressed]
    return modes + ([mode + WITH_COPY for mode in modes] if args.exact_copy else [])


def plain_transformers_reference(worker: ModelWorker, main: LiveSession, new_tokens: list[int], path: Path):
    """The issue's reference: a transformers DynamicCache saved with torch.save in fp16, loaded back."""
    from transformers import DynamicCache

    layers = main.cache.export_layers()
    torch.save([(k.half(), v.half()) for k, v in layers], path)
    input_ids = torch.tensor([new_tokens])

    def run(cache):
        with torch.inference_mode():
            logits = worker.model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
        return int(logits[0, -1].argmax())

    hot = DynamicCache([(k.unsqueeze(0).clone(), v.unsqueeze(0).clone()) for k, v in layers])
    started = time.perf_counter()
    run(hot)
    hot_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    loaded = torch.load(path)
    run(DynamicCache([(k.float().unsqueeze(0), v.float().unsqueeze(0)) for k, v in loaded]))
    load_ms = (time.perf_counter() - started) * 1000
    return hot_ms, load_ms


async def replay(args) -> list[dict]:
    worker = load_worker(args)
    data_dir = Path(tempfile.mkdtemp(prefix="statekeeper-bench-"))
    redis_server = None
    if "redis" in args.tiers:
        from benchmarks.harness.redis_server import RedisServer

        redis_server = RedisServer(data_dir / "redis").start()
    tiers = {
        "dram": TierConfig("dram", 8192 * MiB),
        "lmdb": TierConfig("lmdb", 16384 * MiB, data_dir / "kv.lmdb"),
        "ssd": TierConfig("ssd", 16384 * MiB, data_dir / "kv-files"),
        "redis": TierConfig("redis", 16384 * MiB, url=redis_server.url if redis_server else None),
    }
    service = build_service(
        ServiceConfig(
            data_dir=data_dir,
            sessions=SessionConfig(idle_offload_seconds=1e9, max_content_chars=10**6,
                                   compression=CompressionConfig(policy="none", codec="none"),  # lossless restores
                                   compress_after_seconds=0, compress_quiet_seconds=0,  # --compressed blobs
                                   placement_policy="lru", exact_copy_tier=args.exact_copy or None),
            tiers=[tiers[name] for name in args.tiers],
        ),
        worker,
    )
    modes = ["hot", *args.tiers, *compressed_modes(args), "recompute"]
    await service.executors.warm_up(service.worker)
    rows = []
    step = 0
    for index, users in enumerate(pick_conversations(args.conversations, args.min_user_chars, args.window)):
        session_id = (await service.create(None, None)).id
        main = service.in_memory(session_id)
        for turn_index, content in enumerate(users):
            history = len(main.conversation.tokens)
            new_tokens = service.formatter.extend(
                main.conversation.tokens, main.conversation.chat_messages() + [{"role": "user", "content": content}]
            ).tokens
            if len(new_tokens) + REPLY_TOKENS + CONTEXT_RESERVE > worker.context_length:
                break
            if turn_index > 0 and history >= args.min_history:
                row = {"conversation": index, "turn": turn_index, "history_tokens": history,
                       "new_tokens": len(new_tokens) - main.cache.num_tokens}
                samples = {mode: [] for mode in modes}
                compressed = await compressed_blob(service, main) if args.compressed else None
                if compressed is not None:
                    row["compressed_bytes"] = len(compressed)
                for round_index in range(args.rounds):
                    order = modes[step % len(modes) :] + modes[: step % len(modes)]
                    step += 1
                    for mode in order:
                        if mode == "recompute" and round_index > 0:
                            continue  # 10x slower than the rest; one sample is plenty
                        samples[mode].append(await probe(service, main, mode, content, compressed))
                for mode, results in samples.items():
                    row[f"{mode}_ttft_ms"] = statistics.median(r.ttft_ms for r in results)
                    row[f"{mode}_restore_ms"] = statistics.median(r.restore_ms for r in results)
                plain = [plain_transformers_reference(worker, main, new_tokens[main.cache.num_tokens :],
                                                      data_dir / "plain.pt") for _ in range(args.rounds)]
                row["plain_hot_ms"] = statistics.median(hot for hot, _ in plain)
                row["plain_fp16_load_ms"] = statistics.median(load for _, load in plain)
                rows.append(row)
                print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            async for event in service.turn(session_id, TurnRequest(content, max_tokens=REPLY_TOKENS)):
                pass
    service.close()
    if redis_server:
        redis_server.stop()
    return rows


def summarize(rows: list[dict], threads: int, tiers: list[str]) -> str:
    def med(values):
        return statistics.median(values) if values else float("nan")

    header = ["history", "turns", "hot TTFT ms"]
    header += [f"{t} ms (×hot)" for t in tiers] + ["recompute ms (×hot)"]
    header += [f"recompute/{t}" for t in tiers] + [f"{t} restore ms" for t in tiers]
    header += ["plain fp16 torch.save ×hot"]
    table = []
    low = min((r["history_tokens"] for r in rows), default=0)
    buckets = [(f"≥ {low:,}", lambda h: True), ("< 1,500", lambda h: h < 1500), ("≥ 1,500", lambda h: h >= 1500),
               ("≥ 2,000", lambda h: h >= 2000)]
    for label, keep in buckets:
        chosen = [r for r in rows if keep(r["history_tokens"])]
        if not chosen:
            continue

        def ratio(a, b):
            return med([r[a] / r[b] for r in chosen])

        cells = [label, str(len(chosen)), f"{med([r['hot_ttft_ms'] for r in chosen]):.1f}"]
        for mode in [*tiers, "recompute"]:
            cells.append(f"{med([r[f'{mode}_ttft_ms'] for r in chosen]):.1f} ({ratio(f'{mode}_ttft_ms', 'hot_ttft_ms'):.3f}×)")
        cells += [f"{ratio('recompute_ttft_ms', f'{t}_ttft_ms'):.1f}×" for t in tiers]
        cells += [f"{med([r[f'{t}_restore_ms'] for r in chosen]):.1f}" for t in tiers]
        cells.append(f"{ratio('plain_fp16_load_ms', 'plain_hot_ms'):.3f}×")
        table.append(cells)
    return "\n".join([f"torch threads: {threads}; resumed turns measured: {len(rows)}", "",
                      markdown_table(header, table)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--min-history", type=int, default=1000)
    parser.add_argument("--min-user-chars", type=int, default=3000,
                        help="pick conversations whose first --window user messages hold this many characters")
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="samples per mode and turn (median); recompute: 1")
    parser.add_argument("--tiers", default="dram,lmdb", type=lambda v: v.split(","),
                        help="comma-separated subset of dram,lmdb,ssd,redis (redis: a local redis-server is started)")
    parser.add_argument("--compressed", default="", type=lambda v: [t for t in v.split(",") if t],
                        help="comma-separated tiers (of --tiers) to also restore the default compression from")
    parser.add_argument("--exact-copy", default="", help="a tier of --tiers below the first: --compressed tiers "
                        "are probed again with the exact state kept there (EXACT_COPY_TIER)")
    parser.add_argument("--json", help="write every measured row here")
    args = parser.parse_args()
    if not set(args.compressed) <= set(args.tiers):
        parser.error("--compressed tiers must be among --tiers")
    if args.exact_copy and (args.exact_copy not in args.tiers[1:] or not args.compressed):
        parser.error("--exact-copy needs --compressed and a tier of --tiers below the first")
    started = time.time()
    rows = asyncio.run(replay(args))
    print(f"\nmachine: {machine_line()}, torch {torch.__version__}; "
          f"{time.time() - started:.0f} s")
    print(summarize(rows, args.threads, args.tiers + compressed_modes(args)))
    if args.json:
        write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
