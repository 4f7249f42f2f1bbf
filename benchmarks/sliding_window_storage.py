"""What sliding-window layers save in storage (issue 30): bytes of a conversation's stored exact state against
its whole KV, as the history grows, for layer layouts of the models that have such layers.

    python -m benchmarks.sliding_window_storage --window 512 --json sliding.json

Each layout is a tiny random-weight model (benchmarks/harness/tiny_model.py) with the family's attention and a
real model's layer pattern and window: mistral (every layer slides: Mistral 7B v0.1's 4,096-token window, scaled
by --window), gemma3 (five sliding layers to one global, as Gemma 3). The stored size depends on the layout and
the token counts only, not on the weights, so the tiny models give the figures the real ones would, per layer.
Real ShareGPT conversations are replayed turn by turn (replies of --max-tokens greedy tokens), the conversation
is offloaded to LMDB after each turn, and the stored blob's size (GET /v1/sessions/{id} `stored_bytes`, bytes on
disk) is compared with the whole KV (tokens x KV bytes per token)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from benchmarks.harness import machine_line, markdown_table, write_json
from benchmarks.harness.tiny_model import make_tiny_model_dir
from statekeeper.assembly import build_service
from statekeeper.config import CompressionConfig, MiB, ServiceConfig, SessionConfig, TierConfig, WorkerConfig
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.model_loader import load_model
from statekeeper.sessions import TurnRequest
from statekeeper.worker import ModelWorker

LAYOUTS = {
    "mistral": ("mistral-sliding", {"num_hidden_layers": 6}),
    "gemma3": ("gemma3", {"num_hidden_layers": 6,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
}


def worker_for(layout: str, window: int, root: Path) -> ModelWorker:
    family, overrides = LAYOUTS[layout]
    model_dir = make_tiny_model_dir(root / layout, family, sliding_window=window, max_position_embeddings=32768,
                                    **overrides)
    config = WorkerConfig(model=str(model_dir), model_cache_dir=root / "cache")
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


async def replay(layout: str, worker: ModelWorker, users: list[str], max_tokens: int, root: Path) -> list[dict]:
    data_dir = root / f"{layout}-service"
    service = build_service(ServiceConfig(
        data_dir=data_dir, tiers=[TierConfig("lmdb", 16384 * MiB, data_dir / "kv.lmdb")],
        sessions=SessionConfig(idle_offload_seconds=1e9, max_content_chars=10**6, compress_after_seconds=1e9,
                               compression=CompressionConfig(policy="none", codec="none"))), worker)
    rows = []
    try:
        session = (await service.create(None, None)).id
        for content in users:
            async for _ in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
                pass
            view = await service.offload(session)
            whole = view.tokens * worker.kv_bytes_per_token
            rows.append({"layout": layout, "tokens": view.tokens, "stored_bytes": view.stored_bytes,
                         "whole_kv_bytes": whole, "ratio": view.stored_bytes / whole})
    finally:
        service.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default="mistral,gemma3", type=lambda v: v.split(","))
    parser.add_argument("--window", type=int, default=512, help="the sliding layers' window, tokens")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--min-user-chars", type=int, default=4000, help="the conversation's user text at least")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    users = next([text for role, text in conversation if role == "user"][: args.turns]
                 for conversation in sharegpt_conversations(min_turns=args.turns)
                 if sum(len(text) for role, text in conversation[: 2 * args.turns] if role == "user")
                 >= args.min_user_chars)
    print(f"machine: {machine_line()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="statekeeper-sliding-") as root:
        for layout in args.layouts:
            worker = worker_for(layout, args.window, Path(root))
            rows += asyncio.run(replay(layout, worker, users, args.max_tokens, Path(root)))
    print(markdown_table(["layout", "history tokens", "stored bytes", "whole KV bytes", "stored ÷ whole"],
                        [[r["layout"], r["tokens"], f"{r['stored_bytes']:,}", f"{r['whole_kv_bytes']:,}",
                          f"{r['ratio']:.3f}"] for r in rows]))
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
