"""What finding a conversation by its resent messages costs (issue 15): resumed-turn TTFT through
/v1/chat/completions (the whole history resent every turn, as OpenAI clients do) against /v1/sessions on
the same ShareGPT turns, and the lookup's own cost as the index grows.

    python -m benchmarks.openai_api --conversations 7 --rounds 5 --index-sizes 10,1000,100000 --json openai.json

Part 1 starts `statekeeper serve` and replays each conversation twice side by side, turn by turn: once as
an OpenAI client (streamed chat completion of the whole message list) and once over /v1/sessions
(streamed turn with only the new message), each state offloaded to storage after its turn, so every turn
after the first is a resumed one restored from DRAM; the order of the two alternates turn by turn. TTFT
is the client's (request sent -> first streamed token). Replies must be identical: both paths hold the
same tokens.

Part 2 measures, in this process, what the OpenAI path adds before the turn: finding the conversation
(`HistoryStore.find_heads`: digests of the resent messages' prefixes and one LMDB lookup each) in history
stores holding 10, 1,000, 100,000 conversations, for a resent conversation that is found and one that is
not; and, for scale, the template render and tokenization every turn of either API does."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.multiround import ServiceProcess
from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.history import Conversation, LmdbHistory


def pick_conversations(count: int, rounds: int, max_chars: int, min_chars: int) -> list[list[str]]:
    """The first `rounds` user messages of ShareGPT conversations long enough to reach ~2k tokens."""
    picked = []
    for conversation in sharegpt_conversations(min_turns=rounds):
        users = [content[:max_chars] for role, content in conversation if role == "user"][:rounds]
        if sum(map(len, users)) >= min_chars:
            picked.append(users)
        if len(picked) == count:
            return picked
    raise SystemExit("not enough long conversations")


async def streamed(client: httpx.AsyncClient, path: str, body: dict) -> tuple[float, dict, str]:
    """Sends a streamed request; returns the TTFT in ms, the final event and the reply text."""
    started = time.perf_counter()
    ttft_ms, final, text = None, None, []
    async with client.stream("POST", path, json=body | {"stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ttft_ms = ttft_ms or (time.perf_counter() - started) * 1000
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{path}: {event['error']}")
            if "delta" in event:  # /v1/sessions
                text.append(event["delta"])
            for choice in event.get("choices", []):  # OpenAI chunks
                text.append(choice["delta"].get("content") or "")
            if event.get("done") or event.get("usage") or event.get("statekeeper"):  # what the turn ended with
                final = (final or {}) | {key: value for key, value in event.items() if value is not None}
    return ttft_ms, final, "".join(text)


async def replay(client: httpx.AsyncClient, model: str, users: list[str], index: int, max_tokens: int) -> list[dict]:
    session = (await client.post("/v1/sessions", json={})).json()["id"]
    messages, records, conversation = [], [], None
    for round_index, content in enumerate(users):
        messages.append({"role": "user", "content": content})

        async def openai_turn():
            return await streamed(client, "/v1/chat/completions", {
                "model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
                "stream_options": {"include_usage": True}})

        async def sessions_turn():
            return await streamed(client, f"/v1/sessions/{session}/messages", {"content": content, "max_tokens": max_tokens})

        if (index + round_index) % 2 == 0:
            (o_ttft, o_final, o_text), (s_ttft, s_final, s_text) = await openai_turn(), await sessions_turn()
        else:
            (s_ttft, s_final, s_text), (o_ttft, o_final, o_text) = await sessions_turn(), await openai_turn()
        conversation = o_final["statekeeper"]["conversation_id"]
        for name in (conversation, session):
            (await client.post(f"/v1/sessions/{name}/offload")).raise_for_status()
        messages.append({"role": "assistant", "content": o_text})
        records.append({
            "conversation": index, "round": round_index, "history_tokens": s_final["usage"]["prompt_tokens"],
            "openai_ttft_ms": o_ttft, "sessions_ttft_ms": s_ttft, "same_reply": o_text == s_text,
            "openai_source": o_final["statekeeper"]["restore"]["source"], "sessions_source": s_final["restore"]["source"],
            "openai_cached": o_final["usage"]["prompt_tokens_details"]["cached_tokens"],
            "sessions_cached": s_final["usage"]["cached_tokens"]})
    return records


async def end_to_end(url: str, conversations: list[list[str]], max_tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        records = []
        for index, users in enumerate(conversations):  # one at a time: TTFTs of an otherwise idle service
            records += await replay(client, model, users, index, max_tokens)
    return records


def lookup_costs(conversations: list[list[str]], sizes: list[int], repeats: int) -> list[dict]:
    """The lookup of a resent ~2k-token conversation in stores of `sizes` conversations: find_heads when it
    continues a stored one (found) or matches none (not found: then find_branch too, as resume_point does),
    and find_heads then find_branch for a branch (the last user turn edited after six messages)."""
    probe = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
             for i, text in enumerate(m for users in conversations[:1] for u in users for m in (u, u[:400]))]
    rows = []
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="statekeeper-lookup-") as root:
            store = LmdbHistory(Path(root) / "history.lmdb", index_key=secrets.token_bytes(32))
            for start in range(0, size, 10_000):  # filler conversations of six messages each
                store.save_many([Conversation(id=f"c{i}", created_at="", found_by_messages=True, messages=[
                    {"role": "user" if j % 2 == 0 else "assistant", "content": f"filler {i} {j} " * 40}
                    for j in range(6)]) for i in range(start, min(size, start + 10_000))])
            store.save(Conversation(id="probe", created_at="", messages=probe[:-1], found_by_messages=True))
            branch = probe[:6] + [{"role": "user", "content": "an edited turn"}]
            cases = (("found", probe), ("not found", [{"role": "user", "content": "x"}] + probe), ("branch", branch))
            for name, messages in cases:
                times = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    found = store.find_heads(messages[:-1])
                    sources = store.find_branch(messages[:-1])[0] if not found else []
                    times.append((time.perf_counter() - started) * 1e6)
                assert bool(found) == (name == "found") and bool(sources) == (name == "branch")
                rows.append({"index_entries": size + 1, "case": name, "messages": len(messages),
                             "median_us": statistics.median(times), "p95_us": percentile(times, 0.95)})
            store.close()
    return rows


def render_cost(conversations: list[list[str]], model_cache: Path, repeats: int) -> dict:
    """Template render + tokenization of a ~2k-token conversation, which every turn of either API does."""
    from transformers import AutoTokenizer

    from statekeeper.chat import ChatFormatter
    from statekeeper.model_loader import resolve_model_dir

    formatter = ChatFormatter(AutoTokenizer.from_pretrained(resolve_model_dir("smollm2", model_cache)))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": text}
                for i, text in enumerate(m for users in conversations[:1] for u in users for m in (u, u[:400]))]
    history = formatter.encode(formatter.render(messages[:-1], add_generation_prompt=False))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        formatter.extend(history, messages)
        times.append((time.perf_counter() - started) * 1e6)
    return {"history_tokens": len(history), "median_us": statistics.median(times)}


def ratio_table(records: list[dict]) -> str:
    rows = []
    for low, high in ((0, 1000), (1000, 1500), (1500, 2000), (2000, 10**9), (1500, 10**9)):
        turns = [r for r in records if r["round"] > 0 and low <= r["history_tokens"] < high]
        if not turns:
            continue
        label = f"≥ {low:,}" if high == 10**9 else f"{low:,}–{high:,}"
        ratios = [r["openai_ttft_ms"] / r["sessions_ttft_ms"] for r in turns]
        rows.append([label, len(turns), f"{statistics.median(r['sessions_ttft_ms'] for r in turns):,.0f}",
                     f"{statistics.median(r['openai_ttft_ms'] for r in turns):,.0f}",
                     f"{statistics.median(ratios):.3f}", f"{sum(r['same_reply'] for r in turns)}/{len(turns)}"])
    return markdown_table(["history tokens", "resumed turns", "/v1/sessions TTFT ms (p50)",
                           "/v1/chat/completions TTFT ms (p50)", "completions ÷ sessions (median of per-turn ratios)",
                           "same reply"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=4000)
    parser.add_argument("--min-chars", type=int, default=8000, help="user text per conversation: long histories")
    parser.add_argument("--index-sizes", default="10,1000,100000", type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--json")
    parser.add_argument("--lookups-only", action="store_true", help="only the lookup and render costs")
    args = parser.parse_args()

    conversations = pick_conversations(args.conversations, args.rounds, args.max_chars, args.min_chars)
    env = {"STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache), "STATEKEEPER_IDLE_OFFLOAD_SECONDS": "3600"}
    records = []
    with tempfile.TemporaryDirectory(prefix="statekeeper-openai-") as root:
        service = ServiceProcess(Path(root), env)
        if not args.lookups_only:
            service.start()
            try:
                records = asyncio.run(end_to_end(service.url, conversations, args.max_tokens))
            finally:
                service.stop()
    print(f"machine: {machine_line()}; {len(conversations)} ShareGPT conversations × "
          f"{args.rounds} rounds, max_tokens {args.max_tokens}, states offloaded to DRAM after every turn\n")
    print(ratio_table(records), flush=True)
    lookups = lookup_costs(conversations, args.index_sizes, args.repeats)
    render = render_cost(conversations, args.model_cache, args.repeats)
    print("\n" + markdown_table(["index entries", "resent conversation", "messages", "lookup median µs", "p95 µs"],
                                [[f"{row['index_entries']:,}", row["case"], row["messages"], f"{row['median_us']:,.1f}",
                                  f"{row['p95_us']:,.1f}"] for row in lookups]))
    print(f"\ntemplate render + tokenization of the new turn ({render['history_tokens']:,}-token history): "
          f"median {render['median_us']:,.0f} µs (both APIs)")
    sources = {(r["openai_source"], r["sessions_source"]) for r in records if r["round"] > 0}
    print(f"restore sources (completions, sessions) of resumed turns: {sorted(sources)}")
    if args.json:
        write_json(args.json, {"args": vars(args) | {"model_cache": str(args.model_cache)}, "turns": records,
                               "lookups": lookups, "render": render})


if __name__ == "__main__":
    main()
