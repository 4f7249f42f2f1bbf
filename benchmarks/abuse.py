"""A scripted hostile client against a live `statekeeper serve` (issue 28's acceptance): what each abuse
gets back, what it costs the other users meanwhile, and whether the server's memory comes back after.

    python -m benchmarks.abuse --json abuse.json                    # probes 1-4 against one server
    python -m benchmarks.abuse --replicas --json abuse.json         # and probe 5 against two replicas
    python -m benchmarks.abuse --model tiny --window 6 --probes 1,2  # quick development run (tiny model)

The service runs as a real subprocess (benchmarks/multiround.py's ServiceProcess) on a fresh data
directory, with STATEKEEPER_SEND_TIMEOUT_SECONDS and STATEKEEPER_HEADER_TIMEOUT_SECONDS shortened
(--send-timeout, --header-timeout: 3 s each by default, against 30 and 10 in production) so that the
slow-client probes finish in seconds; everything else is the service's default (TORCH_THREADS=1).

Other users: a well-behaved client in a process of its own (so that the probes' own work on this side does
not delay its clock), --users concurrent users replaying real ShareGPT user messages
(statekeeper.evaluation.datasets) through the native API: POST /v1/sessions, then --rounds turns of POST
/v1/sessions/{id}/messages with "stream": true, max_tokens --max-tokens, greedy, 0.5-1.5 s of think time
before each turn; a finished conversation is deleted and the user starts the next one. Its TTFT is the
time from sending a turn to the first SSE `data:` line that carries a delta. Every measuring window
restarts the same seeded schedule (same conversations, same think times), so a probe's window and the
quiet window measured just before it replay the same prompts, and ends by deleting the client's open
conversations.

Probes, each bounded in count and in time, loopback only; each is measured in a window of at least
--window seconds (longer if the probe itself runs longer), right after a quiet window of --window seconds:
  1 fields     oversized and pathological fields on every route of both APIs (and the admin API): content
               and system prompts at and over MAX_CONTENT_CHARS, bodies over MAX_BODY_MB (declared and
               chunked), stop strings (5, one of 257 characters, 4 of 256 with a long max_tokens), metadata
               deeply nested and over 16 KiB, NaN / Infinity / 1e999 / 2^64 as JSON text, lone
               surrogates, invalid UTF-8, 1024 (and 1025) messages in a chat completion (short, and of
               7,000 characters each: 7 MB, under the body limit), /score with 64 (and 65) messages,
               huge max_tokens, negative and huge seeds, a malformed id of 10 KB in every path that takes
               one, non-JSON content types (text/plain, form) on every POST route, JSON of the wrong types,
               64 KB of request headers. One pass; what each case got is in the JSON (`expect` is what
               the README says it should get: informational, only 5xx count against the targets)
  2 methods    --methods requests with invented methods (BREW0, BREW1, ...), then GET /metrics with the
               admin token: no series may name them (check)
  3 readers    --slow-readers raw sockets (SO_RCVBUF 1 KiB) that each send a streamed chat completion
               with max_tokens left out (all the context has room for, up to MAX_TOKENS_LIMIT), greedy, on a
               prompt the model answers at length ("a 10,000-word story"), and never read. The server should
               end those turns after SEND_TIMEOUT_SECONDS and drop the connections. Check: every connection
               dropped by the server (its side of the socket leaves ESTABLISHED in /proc/net/tcp, which also
               gives the bytes its kernel holds for the client) within --slow-reader-seconds; past that the
               probe closes its sockets itself (the server then sees a client that left). The server log's
               "read nothing" lines and the turns in progress (admin stats) are recorded. It runs
               --slow-reader-waves such waves one after the other, and its quiet window and its own last
               --window seconds a wave, so that the p95 is taken over enough turns to be one
  4 headers    --slow-headers raw sockets sending a request's headers a byte a second, never finishing,
               reconnecting when dropped, plus --idle-connections connections that send nothing (kept
               open, reopened when dropped; MAX_CONNECTIONS minus 100 by default) for --window seconds
               (check: every slow connection dropped within HEADER_TIMEOUT_SECONDS + 1.5 s)
  5 deletes    only with --replicas, after the single server is stopped: a throwaway PostgreSQL cluster, a
               redis-server and two `statekeeper serve` replicas over them (tests/utils, as tests/e2e runs
               them); --delete-rounds rounds of --delete-batch conversations: created on A, a turn on B,
               then deleted on A while B offloads them and reads them (GET messages) or while B runs a
               second turn and a prefetch on them after an offload; afterwards every deleted id must answer
               404 on both replicas (GET, GET messages, POST messages). The well-behaved client talks to B.

Targets (evaluated per probe and overall): no response with status >= 500 (the probes' and the
well-behaved client's, a 5xx in a stream's error event included); the well-behaved client's p95 TTFT
during a probe at most 2x its quiet value; the server's memory (VmRSS of the `statekeeper serve` process,
/proc/<pid>/status) after the run within 5% of before it. "Before" is taken after a warm-up window of the
well-behaved client and a settle; "after" once the probes have ended, no turn is in progress, what the
probes left behind (conversations they created) has been deleted through the admin API, and --settle
seconds have passed (12 by default: the service gives the memory its last busy spell left freed back to the
kernel once it has been quiet for GIVE_BACK_MEMORY_AFTER_SECONDS, 10 by default). With --replicas the same
memory target applies to each replica, whose "before" also follows one pass of probe 5's paths without its
races (warm_up_replica_paths: the first restore from the shared tier, on threads that had not run one, keeps
memory for the process's life); the JSON splits each replica's VmRSS (anonymous / file) and holds what its
admin stats say it keeps (conversations, KV, tier bytes, memory given back). A probe's own check
(above) must pass too. Nothing is tuned to pass: a miss is reported as FAIL."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import multiprocessing
import random
import re
import secrets
import select
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import MODEL_CACHE, machine_record, percentile, write_json
from benchmarks.multiround import ServiceProcess
from statekeeper.evaluation.datasets import sharegpt_conversations

THINK_SECONDS = (0.5, 1.5)
TTFT_LIMIT = 2.0  # a probe's p95 TTFT over the quiet window's
MEMORY_LIMIT = 0.05  # after / before - 1
TCP_ESTABLISHED = 1
SEND_DEADLINE_LINE = "read nothing for"  # api/streaming.py's warning when it ends a turn


# -- machine and process ----------------------------------------------------------------------------


def vm_rss_mib(pid: int) -> float | None:
    """VmRSS of the process (not its children), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_parts_mib(pid: int) -> dict:
    """VmRSS split as the kernel counts it: anonymous memory (the heap), file pages mapped (an LMDB map, the
    model's safetensors), shared memory; MiB."""
    parts = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name = line.split(":", 1)[0]
            if name in ("RssAnon", "RssFile", "RssShmem"):
                parts[name] = int(line.split()[1]) / 1024
    return parts


def children_rss_mib(pid: int) -> float:
    """VmRSS of the process's children (the compression process), MiB: reported, not a target."""
    total = 0.0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for child in (task / "children").read_text().split():
                    total += vm_rss_mib(int(child)) or 0.0
    return total


# -- the well-behaved client (a process of its own) ---------------------------------------------------


def pick_conversations(count: int, rounds: int, max_chars: int) -> list[list[str]]:
    picked = []
    for conversation in sharegpt_conversations(min_turns=rounds):
        messages = [content[:max_chars] for role, content in conversation if role == "user"][:rounds]
        if len(messages) == rounds and all(m.strip() for m in messages):
            picked.append(messages)
            if len(picked) == count:
                break
    return picked


def well_behaved_process(conn, conversations: list[list[str]], users: int, max_tokens: int) -> None:
    """Serves windows until told None: ("window", name, url) starts one, anything else ends it; the records
    go back over `conn`."""
    while True:
        message = conn.recv()
        if message is None:
            return
        _, name, url = message
        conn.send(asyncio.run(_window(conn, url, conversations, users, max_tokens)))


async def _window(conn, url: str, conversations, users: int, max_tokens: int) -> dict:
    stop = asyncio.Event()
    started = time.monotonic()
    turns: list[dict] = []
    requests: list[dict] = []  # everything else it sent: creates and deletes

    async def watch() -> None:
        while not conn.poll():
            await asyncio.sleep(0.05)
        conn.recv()
        stop.set()

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(180, connect=10)) as client:
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(_user(client, i, conversations, users, max_tokens, stop, started, turns, requests)
                               for i in range(users)))
        await watcher
    return {"turns": turns, "requests": requests, "seconds": time.monotonic() - started}


async def _pause(stop: asyncio.Event, seconds: float) -> bool:
    """Sleeps `seconds` unless stopped first; True when stopped."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


async def _user(client, index, conversations, users, max_tokens, stop, started, turns, requests) -> None:
    rng = random.Random(index)
    position = index
    while not stop.is_set():
        messages = conversations[position % len(conversations)]
        position += users
        try:
            created = await client.post("/v1/sessions", json={})
            requests.append({"what": "create", "status": created.status_code})
        except httpx.HTTPError as exc:
            requests.append({"what": "create", "status": None, "error": repr(exc)})
            await _pause(stop, 1.0)
            continue
        if created.status_code != 201:
            await _pause(stop, 1.0)
            continue
        session_id = created.json()["id"]
        try:
            for round_index, content in enumerate(messages):
                if await _pause(stop, rng.uniform(*THINK_SECONDS)):
                    break
                turns.append(await _turn(client, session_id, content, max_tokens, index, round_index, started))
        finally:
            try:
                deleted = await client.delete(f"/v1/sessions/{session_id}")
                requests.append({"what": "delete", "status": deleted.status_code})
            except httpx.HTTPError as exc:
                requests.append({"what": "delete", "status": None, "error": repr(exc)})


async def _turn(client, session_id: str, content: str, max_tokens: int, user: int, round_index: int,
                started: float) -> dict:
    record = {"user": user, "round": round_index, "t": time.monotonic() - started, "chars": len(content),
              "status": None, "ttft_ms": None, "error": None}
    body = {"content": content, "max_tokens": max_tokens, "stream": True}
    record["sent_at"] = time.monotonic()  # CLOCK_MONOTONIC: comparable with the probes' times in the main process
    sent = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", f"/v1/sessions/{session_id}/messages", json=body) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = (await response.aread()).decode(errors="replace")[:300]
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "delta" in event and record["ttft_ms"] is None:
                    record["ttft_ms"] = (time.perf_counter() - sent) * 1000
                if "error" in event:
                    record["error"] = f"mid-stream: {event['error']}"
                    record["stream_status"] = event.get("status")
                if event.get("done"):
                    done = True
    except httpx.HTTPError as exc:
        record["error"] = repr(exc)
    record["total_ms"] = (time.perf_counter() - sent) * 1000
    if not done and record["error"] is None:
        record["error"] = "stream ended without its final event"
    return record


# -- raw sockets ---------------------------------------------------------------------------------------


def _read_status(sock: socket.socket, timeout: float) -> tuple[int | None, str | None]:
    """The status of the response on `sock` (read up to the end of its headers), or None and why."""
    sock.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data and len(data) < 65536:
            piece = sock.recv(65536)
            if not piece:
                break
            data += piece
    except (ConnectionResetError, BrokenPipeError) as exc:
        if not data:
            return None, f"reset before a response ({type(exc).__name__})"
    except TimeoutError:
        if not data:
            return None, f"no response within {timeout:g} s"
    match = re.match(rb"HTTP/1\.[01] (\d{3})", data)
    if match is None:
        return None, "closed without a response" if not data else f"not HTTP: {data[:60]!r}"
    return int(match.group(1)), None


def _readable(sock: socket.socket) -> bool:
    """Whether the server has answered (or closed or reset): something to read, without reading it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(0))


def raw_exchange(port: int, head: bytes, chunks=(), timeout: float = 30.0) -> dict:
    """Sends `head` and then `chunks` until the server answers (it may answer an oversized body before it
    is sent whole) or refuses more; returns the status and the body bytes sent."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        deadline = time.monotonic() + 0.5  # a declared length over the limit is answered from the headers
        while time.monotonic() < deadline and not _readable(sock):
            time.sleep(0.01)
        for chunk in chunks:
            if _readable(sock):
                break
            try:
                sock.sendall(chunk)
            except OSError:  # reset, closed, or no room for a minute: the server stopped reading
                break
            sent += len(chunk)
        status, error = _read_status(sock, timeout)
    return {"status": status, "error": error, "body_bytes_sent": sent}


def oversized_body(total: int, block: int = 65536):
    """A JSON body of `total` bytes ({"content": "aaa..."}), as blocks."""
    prefix, suffix = b'{"content": "', b'"}'
    yield prefix
    left = total - len(prefix) - len(suffix)
    piece = b"a" * block
    while left > 0:
        yield piece[:left]
        left -= block
    yield suffix


def request_head(method: str, path: str, port: int, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- probe 1: pathological fields ------------------------------------------------------------------------


def J(value) -> bytes:
    """JSON bytes as Python writes them: NaN / Infinity literals and \\ud800 escapes included."""
    return json.dumps(value).encode()


def build_cases(ctx: dict) -> list[dict]:
    """Every case: name, method, path, body (bytes or None), content type, extra headers, admin token or
    not, raw ("declared" / "chunked" / "head": sent over a raw socket), expect (the README's answer)."""
    S, big, R, M = ctx["session"], ctx["big_session"], ctx["response"], ctx["model"]
    limit, body_limit, text = ctx["max_chars"], ctx["max_body_bytes"], ctx["long_text"]
    cases: list[dict] = []

    def add(name, method, path, body=None, content_type="application/json", expect=(), admin=False, raw=None,
            headers=None, timeout=120.0, created=False):
        cases.append({"name": name, "method": method, "path": path, "body": body, "content_type": content_type,
                      "expect": tuple(expect), "admin": admin, "raw": raw, "headers": headers or {},
                      "timeout": timeout})

    bad_id = "A" * 10240
    id_routes = [("GET", "/v1/sessions/{}", None, False), ("DELETE", "/v1/sessions/{}", None, False),
                 ("POST", "/v1/sessions/{}/offload", None, False), ("POST", "/v1/sessions/{}/prefetch", None, False),
                 ("GET", "/v1/sessions/{}/messages", None, False),
                 ("POST", "/v1/sessions/{}/messages", J({"content": "hi", "max_tokens": 4}), False),
                 ("POST", "/v1/sessions/{}/score", J({"messages": [{"role": "user", "content": "hi"}]}), False),
                 ("GET", "/v1/responses/{}", None, False), ("DELETE", "/v1/responses/{}", None, False),
                 ("POST", "/v1/admin/conversations/{}/offload", None, True),
                 ("POST", "/v1/admin/conversations/{}/prefetch", None, True),
                 ("POST", "/v1/admin/conversations/{}/move", J({"tier": "dram"}), True),
                 ("DELETE", "/v1/admin/conversations/{}", None, True), ("DELETE", "/v1/admin/keys/{}", None, True)]
    for method, template, body, admin in id_routes:
        add(f"10 KB id: {method} {template.format('{id}')}", method, template.format(bad_id), body,
            expect=(400, 404, 422), admin=admin)
    add("path traversal id: GET /v1/sessions/..%2F..%2Fetc%2Fpasswd", "GET", "/v1/sessions/..%2F..%2Fetc%2Fpasswd",
        expect=(404, 422))
    add("NUL bytes in id: GET /v1/sessions/%00...", "GET", "/v1/sessions/" + "%00" * 64, expect=(404, 422))

    post_routes = [("/v1/sessions", False), (f"/v1/sessions/{S}/offload", False), (f"/v1/sessions/{S}/prefetch", False),
                   (f"/v1/sessions/{S}/messages", False), (f"/v1/sessions/{S}/score", False),
                   ("/v1/chat/completions", False), ("/v1/responses", False), ("/v1/admin/keys", True),
                   (f"/v1/admin/conversations/{S}/move", True), (f"/v1/admin/conversations/{S}/offload", True),
                   (f"/v1/admin/conversations/{S}/prefetch", True)]
    for path, admin in post_routes:
        route = path.replace(S, "{id}")
        needs_body = not route.endswith(("/offload", "/prefetch"))  # those read no body
        add(f"text/plain: POST {route}", "POST", path, b"hello", "text/plain", (415,), admin)
        add(f"form: POST {route}", "POST", path, b"a=1&content=hi", "application/x-www-form-urlencoded", (415,), admin)
        add(f"multipart: POST {route}", "POST", path, b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n",
            "multipart/form-data; boundary=x", (415,), admin)
        for label, body in (("JSON array", b"[1, 2, 3]"), ("JSON string", b'"hi"'), ("JSON null", b"null"),
                            ("truncated JSON", b'{"content": "hi'), ("invalid UTF-8", b'{"content": "\xff\xfe"}'),
                            ("NaN at the top", b"NaN"), ("1e999 at the top", b"1e999")):
            add(f"{label}: POST {route}", "POST", path, body, expect=(400, 422) if needs_body else (200,), admin=admin)
        add(f"body over the limit, declared: POST {route}", "POST", path, oversized_body(body_limit + 65536),
            expect=(413,), admin=admin, raw="declared")
        add(f"body over the limit, chunked: POST {route}", "POST", path, oversized_body(body_limit + 65536),
            expect=(413,) if needs_body else (200, 413), admin=admin, raw="chunked")

    # POST /v1/sessions
    add("system at MAX_CONTENT_CHARS", "POST", "/v1/sessions", J({"system": text[:limit]}), expect=(201,))
    add("system over MAX_CONTENT_CHARS", "POST", "/v1/sessions", J({"system": text[:limit] + "x"}), expect=(413,))
    add("system with a lone surrogate", "POST", "/v1/sessions", J({"system": "a\ud800b"}), expect=(422,))
    add("system: wrong type", "POST", "/v1/sessions", J({"system": 5}), expect=(422,))
    add("unknown field", "POST", "/v1/sessions", J({"sytem": "x"}), expect=(422,))

    def nested(depth):
        value = {"leaf": 1}
        for _ in range(depth - 1):
            value = {"a": value}
        return value

    add("metadata 8 levels deep", "POST", "/v1/sessions", J({"metadata": nested(8)}), expect=(201,))
    add("metadata 9 levels deep", "POST", "/v1/sessions", J({"metadata": nested(9)}), expect=(422,))
    add("metadata 200 levels deep", "POST", "/v1/sessions", J({"metadata": nested(200)}), expect=(400, 422))
    add("metadata 900 levels deep (arrays)", "POST", "/v1/sessions",
        b'{"metadata": {"a": ' + b"[" * 900 + b"]" * 900 + b"}}", expect=(400, 422))
    add("metadata 100,000 levels deep (arrays, 200 KB)", "POST", "/v1/sessions",
        b'{"metadata": {"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}", expect=(400, 422))
    add("metadata 16 KiB + 1 as JSON", "POST", "/v1/sessions", J({"metadata": {"k": "x" * (16 * 1024)}}), expect=(422,))
    add("metadata 4 MB", "POST", "/v1/sessions", J({"metadata": {f"k{i}": "x" * 1000 for i in range(4000)}}),
        expect=(422,))
    add("metadata with a lone surrogate key", "POST", "/v1/sessions", J({"metadata": {"\udc00": "x"}}),
        expect=(201, 422))
    add("metadata with a NUL character", "POST", "/v1/sessions", J({"metadata": {"k": "a\u0000b"}}), expect=(201, 422))
    add("system with NUL characters", "POST", "/v1/sessions", J({"system": "be\u0000brief"}), expect=(201, 422))
    add("metadata: wrong type", "POST", "/v1/sessions", J({"metadata": [1, 2]}), expect=(422,))
    add("compression ratio NaN", "POST", "/v1/sessions", b'{"compression": {"ratio": NaN}}', expect=(422,))
    add("compression group_size 1e999", "POST", "/v1/sessions", b'{"compression": {"group_size": 1e999}}',
        expect=(422,))
    add("compression group_size 2^64", "POST", "/v1/sessions", J({"compression": {"group_size": 2**64}}), expect=(422,))
    add("compression codec 10 KB", "POST", "/v1/sessions", J({"compression": {"codec": "int4" * 2560}}), expect=(422,))

    # POST /v1/sessions/{id}/messages
    msg = f"/v1/sessions/{S}/messages"
    add("content at MAX_CONTENT_CHARS (own session)", "POST", f"/v1/sessions/{big}/messages",
        J({"content": text[:limit], "max_tokens": 4}), expect=(200, 400))
    add("content over MAX_CONTENT_CHARS", "POST", msg, J({"content": text[:limit] + "x", "max_tokens": 4}),
        expect=(413,))
    add("content of 'a' x MAX_CONTENT_CHARS + 1", "POST", msg, J({"content": "a" * (limit + 1)}), expect=(413,))
    add("content with a lone surrogate", "POST", msg, J({"content": "hi \ud800", "max_tokens": 4}), expect=(422,))
    add("content: wrong type (int)", "POST", msg, J({"content": 5}), expect=(422,))
    add("content: wrong type (list)", "POST", msg, J({"content": ["hi"]}), expect=(422,))
    add("content: null", "POST", msg, J({"content": None}), expect=(422,))
    add("max_tokens 2^31", "POST", msg, J({"content": "hi", "max_tokens": 2**31}), expect=(400,))
    add("max_tokens 10^30", "POST", msg, J({"content": "hi", "max_tokens": 10**30}), expect=(400, 422))
    add("max_tokens -1", "POST", msg, J({"content": "hi", "max_tokens": -1}), expect=(422,))
    add("max_tokens '10' (string)", "POST", msg, J({"content": "hi", "max_tokens": "ten"}), expect=(422,))
    add("max_tokens 1e999", "POST", msg, b'{"content": "hi", "max_tokens": 1e999}', expect=(422,))
    add("seed -1", "POST", msg, J({"content": "hi", "seed": -1, "max_tokens": 4}), expect=(422,))
    add("seed 2^63", "POST", msg, J({"content": "hi", "seed": 2**63, "max_tokens": 4}), expect=(422,))
    add("seed 2^64", "POST", msg, J({"content": "hi", "seed": 2**64, "max_tokens": 4}), expect=(422,))
    add("seed 10^100", "POST", msg, J({"content": "hi", "seed": 10**100, "max_tokens": 4}), expect=(422,))
    add("seed 2^63-1, temperature 1", "POST", msg,
        J({"content": "hi", "seed": 2**63 - 1, "temperature": 1.0, "max_tokens": 4}), expect=(200,))
    add("temperature NaN", "POST", msg, b'{"content": "hi", "temperature": NaN}', expect=(422,))
    add("temperature Infinity", "POST", msg, b'{"content": "hi", "temperature": Infinity}', expect=(422,))
    add("temperature -Infinity", "POST", msg, b'{"content": "hi", "temperature": -Infinity}', expect=(422,))
    add("temperature 1e999", "POST", msg, b'{"content": "hi", "temperature": 1e999}', expect=(422,))
    add("top_p 1e-320 (denormal), temperature 1", "POST", msg,
        J({"content": "hi", "top_p": 1e-320, "temperature": 1.0, "max_tokens": 4}), expect=(200, 422))
    add("top_p NaN", "POST", msg, b'{"content": "hi", "top_p": NaN}', expect=(422,))
    add("stream: 'yes'", "POST", msg, J({"content": "hi", "stream": "yes", "max_tokens": 4}),
        expect=(200, 422))  # pydantic's lax mode reads "yes" as true
    add("content with NUL characters", "POST", msg, J({"content": "hi\u0000there", "max_tokens": 4}),
        expect=(200, 422))

    # POST /v1/sessions/{id}/score
    pairs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi" if i % 2 == 0 else "hello"}
             for i in range(64)]
    add("/score with 64 messages", "POST", f"/v1/sessions/{S}/score", J({"messages": pairs}), expect=(200, 400))
    add("/score with 65 messages", "POST", f"/v1/sessions/{S}/score", J({"messages": pairs + pairs[:1]}),
        expect=(422,))
    long_pairs = [dict(p, content=text[:30_000]) for p in pairs]
    add("/score with 64 messages of 30,000 characters (1.9 MB)", "POST", f"/v1/sessions/{S}/score",
        J({"messages": long_pairs}), expect=(400, 413))
    add("/score: role system", "POST", f"/v1/sessions/{S}/score",
        J({"messages": [{"role": "system", "content": "x"}]}), expect=(422,))
    add("/score: messages not a list", "POST", f"/v1/sessions/{S}/score", J({"messages": "hi"}), expect=(422,))

    # POST /v1/chat/completions
    chat = "/v1/chat/completions"

    def completion(**fields):
        return {"model": M, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4} | fields

    add("chat: content at MAX_CONTENT_CHARS", "POST", chat,
        J(completion(messages=[{"role": "user", "content": text[:limit]}])), expect=(200, 400))
    add("chat: content over MAX_CONTENT_CHARS", "POST", chat,
        J(completion(messages=[{"role": "user", "content": text[:limit] + "x"}])), expect=(413,))
    add("chat: 5 stop strings", "POST", chat, J(completion(stop=["a", "b", "c", "d", "e"])), expect=(400,))
    add("chat: a 257-character stop string", "POST", chat, J(completion(stop="s" * 257)), expect=(400,))
    add("chat: 4 stop strings of 256 characters, max_tokens 512", "POST", chat,
        J(completion(messages=[{"role": "user", "content": "Count from 1 to 2000, separated by commas."}],
                     stop=[c * 256 for c in "wxyz"], max_tokens=512, temperature=0)), expect=(200,), timeout=300)
    add("chat: a stop string with a lone surrogate", "POST", chat, J(completion(stop=["\ud800"])), expect=(400,))
    short = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi" if i % 2 == 0 else "hello"}
             for i in range(1023)]
    add("chat: 1024 messages", "POST", chat, J(completion(messages=short + [{"role": "user", "content": "hi"}])),
        expect=(200, 400))
    add("chat: 1025 messages", "POST", chat,
        J(completion(messages=short + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "hi"}])),
        expect=(400,))
    heavy = [dict(m, content=text[:7000]) for m in short] + [{"role": "user", "content": text[:7000]}]
    add("chat: 1024 messages of 7,000 characters (7.2 MB)", "POST", chat, J(completion(messages=heavy)),
        expect=(400,), timeout=300)
    add("chat: 100,000 content parts", "POST", chat,
        J(completion(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * 100_000}])),
        expect=(413,))  # joined: over MAX_CONTENT_CHARS
    add("chat: max_tokens 10^30", "POST", chat, J(completion(max_tokens=10**30)), expect=(400,))
    add("chat: max_tokens 2^31", "POST", chat, J(completion(max_tokens=2**31)), expect=(400,))
    add("chat: max_completion_tokens -1", "POST", chat, J(completion(max_completion_tokens=-1)), expect=(400,))
    add("chat: seed -1", "POST", chat, J(completion(seed=-1)), expect=(400,))
    add("chat: seed 2^64", "POST", chat, J(completion(seed=2**64)), expect=(400,))
    add("chat: temperature NaN", "POST", chat, J(completion(temperature=float("nan"))), expect=(400,))
    add("chat: top_p Infinity", "POST", chat, J(completion(top_p=float("inf"))), expect=(400,))
    add("chat: n 2", "POST", chat, J(completion(n=2)), expect=(400,))
    add("chat: n 10^30", "POST", chat, J(completion(n=10**30)), expect=(400,))
    add("chat: tools", "POST", chat, J(completion(tools=[{"type": "function"}])), expect=(400,))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    add("chat: a tool on a template without tools", "POST", chat, J(completion(tools=[tool])), expect=(400,))
    add("chat: 129 tools", "POST", chat, J(completion(tools=[tool] * 129)), expect=(400,))
    add("chat: tool parameters nested 500 deep", "POST", chat,
        J(completion(tools=[{"type": "function", "function": {"name": "f", "parameters": nested(500)}}])),
        expect=(400,))
    add("chat: a tool name of 10 KB", "POST", chat,
        J(completion(tools=[{"type": "function", "function": {"name": "f" * 10240}}])), expect=(400,))
    add("chat: tool_choice required", "POST", chat, J(completion(tools=[tool], tool_choice="required")),
        expect=(400,))
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "x" * (limit + 1)}}
    add("chat: tool call arguments over MAX_CONTENT_CHARS", "POST", chat, J(completion(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}])), expect=(413,))
    add("chat: 10,000 tool calls in one message", "POST", chat, J(completion(messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [dict(call, function={
            "name": "f", "arguments": "{}"})] * 10_000}, {"role": "user", "content": "hi"}])), expect=(400,))
    add("chat: chat_template_kwargs naming add_generation_prompt", "POST", chat,
        J(completion(chat_template_kwargs={"add_generation_prompt": False})), expect=(400,))
    add("chat: chat_template_kwargs with 17 entries", "POST", chat,
        J(completion(chat_template_kwargs={f"k{i}": 1 for i in range(17)})), expect=(400,))
    add("chat: chat_template_kwargs with an object value", "POST", chat,
        J(completion(chat_template_kwargs={"k": {"deep": nested(100)}})), expect=(400,))
    add("chat: unknown model", "POST", chat, J(completion(model="x" * 10000)), expect=(404,))
    add("chat: model a number", "POST", chat, J(completion(model=5)), expect=(400,))
    add("chat: messages empty", "POST", chat, J(completion(messages=[])), expect=(400,))
    add("chat: messages an object", "POST", chat, J(completion(messages={"role": "user"})), expect=(400,))
    add("chat: last message the assistant's", "POST", chat,
        J(completion(messages=[{"role": "assistant", "content": "x"}])), expect=(400,))
    add("chat: role tool", "POST", chat, J(completion(messages=[{"role": "tool", "content": "x"}])), expect=(400,))
    add("chat: content with a lone surrogate", "POST", chat,
        J(completion(messages=[{"role": "user", "content": "\udfff"}])), expect=(400,))
    add("chat: stop a number", "POST", chat, J(completion(stop=5)), expect=(400,))
    add("chat: X-Statekeeper-Conversation of 10 KB", "POST", chat, J(completion()), headers={
        "X-Statekeeper-Conversation": "c" * 10240}, expect=(400, 422))
    add("chat: prompt_cache_key of 10 KB", "POST", chat, J(completion(prompt_cache_key="c" * 10240)),
        expect=(200, 400))
    add("chat: stream_options a string", "POST", chat, J(completion(stream=True, stream_options="x")), expect=(400,))

    # POST /v1/responses, GET and DELETE /v1/responses/{id}
    resp = "/v1/responses"

    def response_body(**fields):
        return {"model": M, "input": "Say hi.", "max_output_tokens": 4} | fields

    add("responses: input at MAX_CONTENT_CHARS", "POST", resp, J(response_body(input=text[:limit])),
        expect=(200, 400))
    add("responses: input over MAX_CONTENT_CHARS", "POST", resp, J(response_body(input=text[:limit] + "x")),
        expect=(413,))
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(1025)]
    add("responses: 1024 input items", "POST", resp, J(response_body(input=items[1:])), expect=(200, 400))
    add("responses: 1025 input items", "POST", resp, J(response_body(input=items)), expect=(400,))
    add("responses: metadata of 1 MB", "POST", resp,
        J(response_body(metadata={f"k{i}": "v" * 1000 for i in range(1000)})), expect=(400,))
    add("responses: metadata nested", "POST", resp, J(response_body(metadata={"a": {"b": "c"}})), expect=(400,))
    add("responses: previous_response_id of 65 characters", "POST", resp,
        J(response_body(previous_response_id="r" * 65)), expect=(400,))
    add("responses: previous_response_id unknown", "POST", resp, J(response_body(previous_response_id="resp_x")),
        expect=(404,))
    add("responses: max_output_tokens 10^30", "POST", resp, J(response_body(max_output_tokens=10**30)), expect=(400,))
    add("responses: temperature NaN", "POST", resp, J(response_body(temperature=float("nan"))), expect=(400,))
    add("responses: stream true", "POST", resp, J(response_body(stream=True)), expect=(400,))
    add("responses: instructions over MAX_CONTENT_CHARS", "POST", resp,
        J(response_body(instructions=text[:limit] + "x")), expect=(413,))
    add("responses: instructions with a lone surrogate", "POST", resp, J(response_body(instructions="\ud800")),
        expect=(400,))
    add("responses: input a number", "POST", resp, J(response_body(input=5)), expect=(400,))
    add("responses: GET a stored response", "GET", f"{resp}/{R}", expect=(200,))
    add("responses: GET an id of 65 characters", "GET", f"{resp}/{'r' * 65}", expect=(400, 422))

    # admin and the rest
    add("admin: POST keys, tenant of 10 KB", "POST", "/v1/admin/keys", J({"tenant": "t" * 10240}), expect=(422,),
        admin=True)
    add("admin: POST keys, tenant a number", "POST", "/v1/admin/keys", J({"tenant": 5}), expect=(422,), admin=True)
    add("admin: conversations, prefix of 10 KB", "GET", "/v1/admin/conversations?prefix=" + "p" * 10240,
        expect=(422,), admin=True)
    add("admin: conversations, limit 10^30", "GET", f"/v1/admin/conversations?limit={10**30}", expect=(422,),
        admin=True)
    add("admin: move to a tier of 10 KB", "POST", f"/v1/admin/conversations/{S}/move", J({"tier": "t" * 10240}),
        expect=(422,), admin=True)
    add("admin: move to an unknown tier", "POST", f"/v1/admin/conversations/{S}/move", J({"tier": "tape"}),
        expect=(400, 404, 422), admin=True)
    add("admin: a wrong token of 10 KB", "GET", "/v1/admin/tiers", headers={"Authorization": "Bearer " + "t" * 10240},
        expect=(401,))
    add("metrics: without the token", "GET", "/metrics", expect=(401,))
    add("metrics: query string of 10 KB", "GET", "/metrics?" + "q" * 10240, expect=(200,), admin=True)
    add("healthz: query string of 10 KB", "GET", "/healthz?" + "q" * 10240, expect=(200,))
    add("GET /v1/models", "GET", "/v1/models", expect=(200,))
    add("request headers of 64 KB", "GET", "/healthz", headers={f"X-Pad-{i}": "p" * 1000 for i in range(64)},
        raw="head", expect=(200, 400, 431))
    add("a 32 KB request line", "GET", "/healthz?" + "q" * 32768, raw="head", expect=(200, 400, 414, 431))
    return cases


async def send_case(client: httpx.AsyncClient, port: int, case: dict, admin_token: str) -> dict:
    headers = dict(case["headers"])
    if case["admin"]:
        headers["Authorization"] = f"Bearer {admin_token}"
    started = time.perf_counter()
    result = {"name": case["name"], "method": case["method"], "route": case["path"][:120], "expect": case["expect"],
              "started_at": time.monotonic()}
    if case["raw"] in ("declared", "chunked"):
        blocks = list(case["body"])
        total = sum(len(b) for b in blocks)
        headers |= {"Content-Type": case["content_type"]}
        if case["raw"] == "declared":
            headers["Content-Length"] = str(total)
            chunks = blocks
        else:
            headers["Transfer-Encoding"] = "chunked"
            chunks = [f"{len(b):x}\r\n".encode() + b + b"\r\n" for b in blocks] + [b"0\r\n\r\n"]
        head = request_head(case["method"], case["path"], port, headers)
        outcome = await asyncio.to_thread(raw_exchange, port, head, chunks, case["timeout"])
        result |= outcome | {"body_bytes": total}
    elif case["raw"] == "head":
        head = request_head(case["method"], case["path"], port, headers)
        result |= await asyncio.to_thread(raw_exchange, port, head, (), case["timeout"])
    else:
        if case["body"] is not None:
            headers["Content-Type"] = case["content_type"]
        try:
            try:
                response = await client.request(case["method"], case["path"], content=case["body"], headers=headers,
                                                timeout=case["timeout"])
            except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                # a kept-alive connection the server closed after its previous answer (uvicorn closes one
                # after an unhandled exception): sent again on a new one, as clients do
                result["retried_after"] = repr(exc)
                response = await client.request(case["method"], case["path"], content=case["body"], headers=headers,
                                                timeout=case["timeout"])
            result |= {"status": response.status_code, "error": None, "body": response.text[:300]}
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                payload = response.json()
                result["created"] = [x for x in (payload.get("id") if case["path"] == "/v1/sessions" else None,
                                                 (payload.get("statekeeper") or {}).get("conversation_id"))
                                     if x]
                if case["path"] == "/v1/responses" and response.status_code == 200:
                    result["response_id"] = payload.get("id")
        except httpx.HTTPError as exc:
            result |= {"status": None, "error": repr(exc)}
    result["ms"] = (time.perf_counter() - started) * 1000
    result["ended_at"] = time.monotonic()
    result["unexpected"] = bool(case["expect"]) and result.get("status") not in case["expect"]
    return result


async def probe_fields(client: httpx.AsyncClient, port: int, admin_token: str, ctx: dict, verbose: bool) -> dict:
    cases = build_cases(ctx)
    results = []
    for case in cases:
        if verbose:
            print(f"  {case['name']} ...", end=" ", flush=True)
        results.append(await send_case(client, port, case, admin_token))
        if verbose:
            print(results[-1].get("status"), results[-1].get("error") or "", f"{results[-1]['ms']:.0f} ms", flush=True)
    unexpected = [r["name"] for r in results if r["unexpected"]]
    return {"requests": len(results), "statuses": [r.get("status") for r in results], "cases": results,
            "created": [c for r in results for c in r.get("created", [])],
            "check": {"ok": True, "text": f"{len(unexpected)} of {len(results)} answers differ from the README's "
                                          "(informational, listed below the table)"}}


# -- probe 2: invented methods ------------------------------------------------------------------------------


def request_series(metrics_text: str) -> list[str]:
    return [line.rsplit(" ", 1)[0] for line in metrics_text.splitlines()
            if line.startswith("statekeeper_http_requests_total{")]


async def probe_methods(client: httpx.AsyncClient, admin_token: str, count: int) -> dict:
    admin = {"Authorization": f"Bearer {admin_token}"}
    before = request_series((await client.get("/metrics", headers=admin)).text)
    paths = ["/healthz", "/v1/sessions", "/metrics", "/v1/chat/completions", "/no/such/path"]
    statuses = []
    for i in range(count):
        try:
            response = await client.request(f"BREW{i}", paths[i % len(paths)])
            statuses.append(response.status_code)
        except httpx.HTTPError:
            statuses.append(None)
    scrape = await client.get("/metrics", headers=admin)
    after = request_series(scrape.text)
    brewed = [s for s in after if "BREW" in s.upper()]
    new = sorted(set(after) - set(before))
    ok = scrape.status_code == 200 and not brewed
    return {"requests": count + 2, "statuses": statuses + [scrape.status_code], "series_before": len(before),
            "series_after": len(after), "new_series": new, "brew_series": brewed,
            "check": {"ok": ok, "text": f"/metrics {scrape.status_code}: {len(brewed)} series name an invented "
                                        f"method; {len(before)} → {len(after)} request series"}}


# -- probe 3: slow readers -----------------------------------------------------------------------------


def server_sockets(port: int) -> dict[int, tuple[int, int]]:
    """The server's side of the loopback connections to `port` (/proc/net/tcp): the peer's port -> (TCP
    state, bytes in the server's send queue). 1 is ESTABLISHED; a socket the server closed is gone or in
    FIN_WAIT1 (4) while the kernel still tries to deliver what it holds."""
    table = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, state, queues = fields[1], fields[2], fields[3], fields[4]
            if int(local.split(":")[1], 16) == port and remote.split(":")[1] != "0000":
                table[int(remote.split(":")[1], 16)] = (int(state, 16), int(queues.split(":")[0], 16))
    return table


def slow_readers(port: int, count: int, model: str, max_tokens: int | None, max_seconds: float) -> dict:
    """`count` streamed chat completions whose clients never read; waits up to `max_seconds` for the server
    to drop every connection (its side leaves ESTABLISHED), then closes the rest itself."""
    sockets, opened = [], []
    for i in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: a small window
        sock.connect(("127.0.0.1", port))
        fields = {"model": model, "stream": True, "temperature": 0,
                  "messages": [{"role": "user", "content": f"Write a 10,000-word story about dragon number {i + 1}. "
                                                           "Do not stop until it is finished."}]}
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        body = J(fields)
        sock.sendall(request_head("POST", "/v1/chat/completions", port,
                                  {"Content-Type": "application/json", "Content-Length": str(len(body))}) + body)
        sockets.append(sock)
        opened.append(time.monotonic())
    peers = [sock.getsockname()[1] for sock in sockets]
    dropped: list[float | None] = [None] * count
    send_queue = [0] * count  # the most the server's kernel held for each, bytes
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline and None in dropped:
        table = server_sockets(port)
        for i, peer in enumerate(peers):
            state, queued = table.get(peer, (0, 0))
            send_queue[i] = max(send_queue[i], queued)
            if dropped[i] is None and state != TCP_ESTABLISHED:
                dropped[i] = time.monotonic() - opened[i]
        time.sleep(0.25)
    for sock in sockets:  # the rest give up: closing with unread data resets the connection
        sock.close()
    return {"dropped_after_s": dropped, "server_send_queue_max_bytes": send_queue,
            "waited_s": time.monotonic() - min(opened)}


async def probe_slow_readers(client: httpx.AsyncClient, admin_token: str, port: int, count: int, model: str,
                             max_tokens: int | None, max_seconds: float, send_timeout: float, log_path: Path,
                             waves: int = 1) -> dict:
    """`waves` waves of `count` slow readers, one after the other: each wave's turns arrive together, so more
    waves give the other users' p95 more turns that met such a burst (one wave's window held 10-13)."""
    results = [await _slow_reader_wave(client, admin_token, port, count, model, max_tokens, max_seconds,
                                       send_timeout, log_path) for _ in range(waves)]
    if waves == 1:
        return results[0]
    return {"requests": count * waves, "statuses": [], "waves": results,
            "check": {"ok": all(r["check"]["ok"] for r in results),
                      "text": f"{waves} waves: " + " | ".join(r["check"]["text"] for r in results)}}


async def _slow_reader_wave(client: httpx.AsyncClient, admin_token: str, port: int, count: int, model: str,
                            max_tokens: int | None, max_seconds: float, send_timeout: float, log_path: Path) -> dict:
    lines_before = log_path.read_text(errors="replace").count(SEND_DEADLINE_LINE)
    task = asyncio.create_task(asyncio.to_thread(slow_readers, port, count, model, max_tokens, max_seconds))
    in_progress = []
    while not task.done():
        await asyncio.sleep(1.0)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            stats = await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})
            in_progress.append(stats.json()["turns_in_progress"])
    outcome = await task
    closed = time.monotonic()
    waited = await settle(client, admin_token, 0.0)  # after the clients closed: until the turns have ended
    ended = log_path.read_text(errors="replace").count(SEND_DEADLINE_LINE) - lines_before
    drops = [d for d in outcome["dropped_after_s"] if d is not None]
    ok = len(drops) == count
    queued = max(outcome["server_send_queue_max_bytes"]) / 1024
    text = (f"{len(drops)}/{count} connections dropped by the server within {max_seconds:g} s"
            + (f" ({min(drops):.1f}–{max(drops):.1f} s)" if drops else "")
            + f"; {ended} turns ended by the {send_timeout:g} s send deadline (server log); server send queue up to "
              f"{queued:,.0f} KiB a connection; turns in progress up to {max(in_progress, default=0)}"
            + ("" if ok else f"; the rest ended {time.monotonic() - closed:.1f} s after the clients closed"))
    return {"requests": count, "statuses": [], "turns_ended_by_send_deadline": ended, **outcome,
            "turns_in_progress": in_progress, "settled_after_close_s": waited, "check": {"ok": ok, "text": text}}


# -- probe 4: slow headers and idle connections --------------------------------------------------------


def _open(port: int) -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.setblocking(False)
        return sock
    except OSError:
        return None


def _gone(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def slow_connections(port: int, slow: int, idle: int, seconds: float) -> dict:
    head = f"POST /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n".encode() + \
        b"X-Slow: " + b"s" * 4096
    stats = {"slow_opened": 0, "slow_dropped": 0, "slow_drop_after_s": [], "slow_refused": 0, "slow_bytes_sent": 0,
             "idle_opened": 0, "idle_dropped": 0, "idle_drop_after_s": [], "idle_refused": 0, "idle_max_open": 0}
    slow_socks: list[list] = []  # [socket, opened at, bytes sent]
    idle_socks: list[list] = []
    deadline = time.monotonic() + seconds
    next_byte = time.monotonic()

    def refill(pool: list, want: int, kind: str) -> None:
        while len(pool) < want and time.monotonic() < deadline:
            sock = _open(port)
            if sock is None:
                stats[f"{kind}_refused"] += 1
                return
            stats[f"{kind}_opened"] += 1
            pool.append([sock, time.monotonic(), 0])

    while time.monotonic() < deadline:
        refill(slow_socks, slow, "slow")
        refill(idle_socks, idle, "idle")
        stats["idle_max_open"] = max(stats["idle_max_open"], len(idle_socks))
        now = time.monotonic()
        send_now = now >= next_byte
        if send_now:
            next_byte = now + 1.0
        for kind, pool in (("slow", slow_socks), ("idle", idle_socks)):
            for entry in list(pool):
                sock, opened, sent = entry
                gone = _gone(sock)
                if not gone and kind == "slow" and send_now:
                    try:
                        sock.send(head[sent % len(head):sent % len(head) + 1])
                        entry[2] += 1
                        stats["slow_bytes_sent"] += 1
                    except OSError:
                        gone = True
                if gone:
                    stats[f"{kind}_dropped"] += 1
                    stats[f"{kind}_drop_after_s"].append(round(time.monotonic() - opened, 2))
                    sock.close()
                    pool.remove(entry)
        time.sleep(0.05)
    for sock, _, _ in slow_socks + idle_socks:
        sock.close()
    return stats


async def probe_slow_headers(client: httpx.AsyncClient, port: int, slow: int, idle: int, seconds: float,
                             header_timeout: float) -> dict:
    task = asyncio.create_task(asyncio.to_thread(slow_connections, port, slow, idle, seconds))
    health = []
    while not task.done():  # the service keeps answering while they hold their connections
        await asyncio.sleep(1.0)
        try:
            health.append((await client.get("/healthz", timeout=30)).status_code)
        except httpx.HTTPError:
            health.append(None)
    stats = await task
    drops = stats["slow_drop_after_s"]
    late = [d for d in drops if d > header_timeout + 1.5]
    ok = stats["slow_dropped"] > 0 and not late and stats["slow_refused"] == 0
    idle_drops = stats["idle_drop_after_s"]
    text = (f"slow: {stats['slow_dropped']}/{stats['slow_opened']} connections dropped "
            f"({min(drops, default=0):.1f}–{max(drops, default=0):.1f} s, {len(late)} later than "
            f"{header_timeout:g} + 1.5 s); idle: up to {stats['idle_max_open']} open at once, "
            f"{stats['idle_dropped']}/{stats['idle_opened']} dropped ({min(idle_drops, default=0):.1f}–"
            f"{max(idle_drops, default=0):.1f} s), {stats['idle_refused'] + stats['slow_refused']} refused; "
            f"/healthz meanwhile: {dict(collections.Counter(health))}")
    return {"requests": stats["slow_opened"] + stats["idle_opened"] + len(health), "statuses": health, **stats,
            "check": {"ok": ok, "text": text}}


# -- probe 5: deletes across two replicas ------------------------------------------------------------------


async def warm_up_replica_paths(a: httpx.AsyncClient, b: httpx.AsyncClient, texts: list[str], batch: int,
                                rounds: int = 2) -> None:
    """Before the replicas' memory is read: every path probe 5 takes once without the races, `batch` at a time
    as it does (created on A, turns on B, stored to the shared tier and restored from it by B, read, deleted
    on A), so that what the first use of a path keeps for the process's life (its threads' arenas, pools and
    kernels) is in "before" on both replicas, as the well-behaved client's warm-up puts the turn path there."""
    for _ in range(rounds):
        ids = [(await a.post("/v1/sessions", json={})).json()["id"] for _ in range(batch)]

        async def one(j: int, sid: str) -> None:
            await b.post(f"/v1/sessions/{sid}/messages", json={"content": texts[j % len(texts)], "max_tokens": 16})
            await b.post(f"/v1/sessions/{sid}/offload")
            await b.post(f"/v1/sessions/{sid}/messages", json={"content": texts[(j + 1) % len(texts)], "max_tokens": 16})
            await b.get(f"/v1/sessions/{sid}/messages")
            await a.delete(f"/v1/sessions/{sid}")

        await asyncio.gather(*(one(j, sid) for j, sid in enumerate(ids)))


async def probe_replica_deletes(a: httpx.AsyncClient, b: httpx.AsyncClient, texts: list[str], rounds: int,
                                batch: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    events: list[dict] = []
    deleted: list[str] = []

    async def call(client, name, method, path, delay=0.0, **kwargs):
        if delay:
            await asyncio.sleep(delay)
        started = time.perf_counter()
        stream_status = None
        try:
            response = await client.request(method, path, timeout=120, **kwargs)
            status, text = response.status_code, response.text[:200]
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                for line in response.text.splitlines():  # a turn that failed after its 200: its error event
                    if line.startswith("data:") and '"error"' in line:
                        with contextlib.suppress(ValueError):
                            event = json.loads(line[5:])
                            stream_status, text = event.get("status"), line[:200]
        except httpx.HTTPError as exc:
            status, text = None, repr(exc)
        events.append({"what": name, "status": status, "stream_status": stream_status,
                       "ms": (time.perf_counter() - started) * 1000,
                       "body": text if status is None or status >= 500 or stream_status else None})
        return status

    def turn_body(i):
        return {"content": texts[i % len(texts)], "max_tokens": 16}

    # First, text PostgreSQL cannot store as LMDB can (a NUL character in text, a lone surrogate in JSONB),
    # on the replica that writes it.
    model = (await a.get("/v1/models")).json()["data"][0]["id"]
    for name, path, body in (
            ("A create, metadata with a NUL character", "/v1/sessions", {"metadata": {"k": "a\u0000b"}}),
            ("A create, metadata with a lone surrogate key", "/v1/sessions", {"metadata": {"\udc00": "x"}}),
            ("A create, system with a NUL character", "/v1/sessions", {"system": "be\u0000brief"}),
            ("A chat, content with a NUL character", "/v1/chat/completions",
             {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi\u0000there"}]}),
            ("A responses, metadata with a NUL character", "/v1/responses",
             {"model": model, "max_output_tokens": 2, "input": "hi", "metadata": {"k": "a\u0000b"}})):
        await call(a, name, "POST", path, content=J(body), headers={"Content-Type": "application/json"})
    created = (await a.post("/v1/sessions", json={})).json()["id"]
    await call(a, "A turn, content with a NUL character", "POST", f"/v1/sessions/{created}/messages",
               json={"content": "hi\u0000there", "max_tokens": 2})
    await call(b, "B GET messages of it", "GET", f"/v1/sessions/{created}/messages")

    for round_index in range(rounds):
        ids = []
        for _ in range(batch):
            response = await a.post("/v1/sessions", json={})
            events.append({"what": "A create", "status": response.status_code})
            if response.status_code == 201:
                ids.append(response.json()["id"])
        await asyncio.gather(*(call(b, "B turn 1", "POST", f"/v1/sessions/{sid}/messages", json=turn_body(j))
                               for j, sid in enumerate(ids)))

        async def race(j: int, sid: str) -> None:
            if j % 2 == 0:  # delete on A while B offloads and reads
                await asyncio.gather(call(b, "B offload", "POST", f"/v1/sessions/{sid}/offload"),
                                     call(b, "B GET messages", "GET", f"/v1/sessions/{sid}/messages",
                                          delay=rng.uniform(0, 0.05)),
                                     call(a, "A delete", "DELETE", f"/v1/sessions/{sid}", delay=rng.uniform(0, 0.2)))
            else:  # B offloads (to Redis) first, then a turn that restores it and a prefetch, while A deletes
                await call(b, "B offload", "POST", f"/v1/sessions/{sid}/offload")
                await asyncio.gather(call(b, "B turn 2", "POST", f"/v1/sessions/{sid}/messages",
                                          json=turn_body(j + round_index) | {"stream": True, "max_tokens": 64}),
                                     call(b, "B prefetch", "POST", f"/v1/sessions/{sid}/prefetch",
                                          delay=rng.uniform(0, 0.05)),
                                     call(a, "A delete", "DELETE", f"/v1/sessions/{sid}", delay=rng.uniform(0, 0.5)))

        await asyncio.gather(*(race(j, sid) for j, sid in enumerate(ids)))
        for sid in ids:  # a delete refused (409: a turn was under way) is sent again, until it is done
            for _ in range(20):
                status = await call(a, "A delete (again)", "DELETE", f"/v1/sessions/{sid}")
                if status in (204, 404):
                    break
                await asyncio.sleep(0.25)
            deleted.append(sid)
    await asyncio.sleep(1.0)
    alive = []
    for sid in deleted:
        for name, client in (("A", a), ("B", b)):
            for what, method, path, body in (("GET", "GET", f"/v1/sessions/{sid}", None),
                                             ("GET messages", "GET", f"/v1/sessions/{sid}/messages", None),
                                             ("POST messages", "POST", f"/v1/sessions/{sid}/messages",
                                              {"content": "still there?", "max_tokens": 1})):
                status = await call(client, f"{name} {what} after delete", method, path, json=body)
                if status != 404:
                    alive.append({"id": sid[:6] + "…", "replica": name, "request": what, "status": status})
    text = f"{len(deleted) - len({x['id'] for x in alive})}/{len(deleted)} deleted conversations answer 404 on both " \
           f"replicas (GET, GET messages, POST messages)"
    if alive:
        text += f"; not 404: {alive[:4]}"
    statuses = [max(e["status"], e.get("stream_status") or 0) if e["status"] else None for e in events]
    return {"requests": len(events), "statuses": statuses, "events": events,
            "deleted": len(deleted), "not_404": alive, "check": {"ok": not alive, "text": text}}


# -- windows ------------------------------------------------------------------------------------------------


class Harness:
    """Runs measuring windows: the well-behaved client (another process) replays its schedule while a probe
    runs here; RSS of the watched processes is sampled meanwhile."""

    def __init__(self, conn, pids: dict[str, int], window: float):
        self.conn = conn
        self.pids = pids
        self.window = window

    async def measure(self, name: str, url: str, probe=None, min_seconds: float | None = None) -> dict:
        self.conn.send(("window", name, url))
        started = time.monotonic()
        samples: list[dict] = []
        sampling = asyncio.create_task(self._sample(samples))
        try:
            try:
                result = await probe() if probe is not None else None
            except Exception as exc:  # reported as the probe's failure; the run goes on
                result = {"requests": 0, "statuses": [], "error": repr(exc),
                          "check": {"ok": False, "text": f"the probe raised {exc!r}"}}
            left = (self.window if min_seconds is None else min_seconds) - (time.monotonic() - started)
            if left > 0:
                await asyncio.sleep(left)
        finally:
            self.conn.send("stop")
            client = await asyncio.to_thread(self.conn.recv)
            sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        peak = {name: max((s[name] for s in samples if s.get(name) is not None), default=None) for name in self.pids}
        return {"name": name, "seconds": time.monotonic() - started, "probe": result, "client": client,
                "rss_peak_mib": peak}

    async def _sample(self, samples: list[dict]) -> None:
        while True:
            samples.append({name: vm_rss_mib(pid) for name, pid in self.pids.items()})
            await asyncio.sleep(0.5)


async def settle(client: httpx.AsyncClient, admin_token: str, seconds: float, max_wait: float = 120.0) -> float:
    """Waits until no turn is in progress (admin stats), then `seconds`; returns the seconds waited in all."""
    started = time.monotonic()
    while time.monotonic() - started < max_wait:
        try:
            stats = (await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})).json()
            if stats.get("turns_in_progress") == 0:
                break
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    await asyncio.sleep(seconds)
    return time.monotonic() - started


async def held_in_memory(client: httpx.AsyncClient, admin_token: str) -> dict:
    """What a replica's admin stats say it holds in memory: conversations, active KV, idle sessions' bytes."""
    stats = (await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})).json()
    return {"sessions_in_memory": stats["sessions_in_memory"], "active_kv_bytes": stats["active_kv_bytes"],
            "idle_bytes": stats["memory"]["idle_sessions"]["bytes"],
            "freed_given_back_bytes": stats["memory"]["freed_given_back_bytes"],
            "heap": stats["memory"].get("heap"),
            "tier_usage_bytes": {tier["name"]: tier["usage_bytes"] for tier in stats["tiers"]}}


def heap_in_use(held: dict | None) -> str:
    """The heap's bytes in use (glibc's, from the admin stats) in MiB, for the memory table; — where unknown."""
    heap = (held or {}).get("heap")
    return "—" if heap is None else f"{heap['in_use'] / 2**20:,.1f}"


def heap_text(held: dict) -> str:
    heap = held.get("heap")
    return "—" if heap is None else f"in use {heap_in_use(held)} MiB, freed and kept {heap['free_held'] / 2**20:,.1f} MiB"


async def delete_everything(client: httpx.AsyncClient, admin_token: str) -> dict:
    """Deletes every conversation the service holds (through the admin API): what the probes left behind."""
    admin = {"Authorization": f"Bearer {admin_token}"}
    ids, after = [], ""
    while True:
        page = (await client.get(f"/v1/admin/conversations?limit=200&after={after}", headers=admin)).json()
        ids += [row["id"] for row in page["data"]]
        after = page.get("next_after")
        if not after:
            break
    statuses = collections.Counter()
    for sid in ids:
        for _ in range(20):
            status = (await client.delete(f"/v1/admin/conversations/{sid}", headers=admin)).status_code
            if status != 409:
                break
            await asyncio.sleep(0.25)
        statuses[status] += 1
    return {"conversations": len(ids), "statuses": dict(statuses)}


# -- the report --------------------------------------------------------------------------------------------


def ttft_p95(window: dict) -> float | None:
    return percentile([t["ttft_ms"] for t in window["client"]["turns"] if t["ttft_ms"] is not None], 0.95)


def client_statuses(window: dict) -> list:
    turns = window["client"]["turns"]
    return [max(t["status"] or 0, t.get("stream_status") or 0) or None for t in turns] + \
        [r["status"] for r in window["client"]["requests"]]


def status_text(statuses: list) -> str:
    counts = collections.Counter("no response" if s is None else s for s in statuses)
    numbers = sorted(k for k in counts if isinstance(k, int))
    parts = [f"{k}×{counts[k]}" for k in numbers] + ([f"no response×{counts['no response']}"]
                                                     if "no response" in counts else [])
    return ", ".join(parts) or "—"


def probe_row(label: str, quiet: dict, during: dict) -> dict:
    probe = during["probe"]
    client_5xx = sum(1 for s in client_statuses(during) if s is not None and s >= 500)
    probe_5xx = sum(1 for s in probe["statuses"] if s is not None and s >= 500)
    q, d = ttft_p95(quiet), ttft_p95(during)
    ratio = d / q if q and d else None
    turns = during["client"]["turns"]
    errors = sum(1 for t in turns if t["error"])
    check = probe.get("check")
    passed = (probe_5xx + client_5xx == 0 and ratio is not None and ratio <= TTFT_LIMIT
              and (check is None or check["ok"]))
    return {"probe": label, "slowest_turns": slowest_turns(during), "requests": probe["requests"], "statuses": status_text(probe["statuses"]),
            "probe_5xx": probe_5xx, "client_5xx": client_5xx, "client_turns": len(turns), "client_errors": errors,
            "quiet_turns": len(quiet["client"]["turns"]), "ttft_p95_quiet_ms": q, "ttft_p95_during_ms": d,
            "ttft_ratio": ratio, "window_s": during["seconds"], "check": check, "passed": passed}


def slowest_turns(window: dict, count: int = 3) -> list[dict]:
    """The other users' slowest first tokens during a probe, with the probe's requests under way meanwhile."""
    cases = (window.get("probe") or {}).get("cases", [])
    turns = sorted((t for t in window["client"]["turns"] if t["ttft_ms"] is not None), key=lambda t: -t["ttft_ms"])
    picked = []
    for turn in turns[:count]:
        begin, end = turn["sent_at"], turn["sent_at"] + turn["ttft_ms"] / 1000
        meanwhile = [c["name"] for c in cases if c["started_at"] < end and c["ended_at"] > begin]
        picked.append({"ttft_ms": turn["ttft_ms"], "chars": turn["chars"], "round": turn["round"],
                       "meanwhile": meanwhile})
    return picked


def cell(value, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[dict], memory: list[dict]) -> str:
    lines = ["| probe | requests sent | statuses seen | 5xx (probe / other users) | other users' turns (errors) "
             "| p95 TTFT quiet ms (turns) | p95 TTFT during ms | ratio (≤ 2) | probe check | result |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        check = r["check"]["text"] if r["check"] else "—"
        lines.append(f"| {r['probe']} | {r['requests']} | {r['statuses']} | {r['probe_5xx']} / {r['client_5xx']} "
                     f"| {r['client_turns']} ({r['client_errors']}) | {cell(r['ttft_p95_quiet_ms'])} "
                     f"({r['quiet_turns']}) | {cell(r['ttft_p95_during_ms'])} | {cell(r['ttft_ratio'], 2)}× | "
                     f"{check} | {'PASS' if r['passed'] else 'FAIL'} |")
    lines += ["", "| server process | VmRSS before MiB | after MiB | after ÷ before (≤ 1.05) | heap in use before / after "
                  "MiB | peak during probes MiB | compression child before / after MiB | result |",
              "|---|---|---|---|---|---|---|---|"]
    for m in memory:
        lines.append(f"| {m['process']} | {cell(m['before_mib'], 1)} | {cell(m['after_mib'], 1)} | "
                     f"{cell(m['ratio'], 3)}× | {heap_in_use(m.get('held_before'))} / {heap_in_use(m.get('held_after'))} "
                     f"| {cell(m['peak_mib'], 1)} | {cell(m['children_before_mib'], 1)} / "
                     f"{cell(m['children_after_mib'], 1)} | {'PASS' if m['passed'] else 'FAIL'} |")
    return "\n".join(lines)


def memory_row(process: str, before: float, after: float, peak: float | None, children: tuple) -> dict:
    ratio = after / before if before and after else None
    return {"process": process, "before_mib": before, "after_mib": after, "ratio": ratio, "peak_mib": peak,
            "children_before_mib": children[0], "children_after_mib": children[1],
            "passed": ratio is not None and ratio <= 1 + MEMORY_LIMIT}


def server_errors(log_path: Path, limit: int = 40) -> list[str]:
    """The server log's error lines and tracebacks, for the report."""
    if not log_path.exists():
        return []
    lines = log_path.read_text(errors="replace").splitlines()
    picked = [line for line in lines if re.search(r"Traceback|ERROR|Exception|Error:| 5\d\d ", line)]
    return picked[:limit]


# -- the run -----------------------------------------------------------------------------------------------


async def single_server(args, harness: Harness, service: ServiceProcess, admin_token: str, long_text: str) -> dict:
    url, port = service.url, service.port
    pid = service.process.pid
    admin = {"Authorization": f"Bearer {admin_token}"}
    windows, rows = [], []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warmup = await harness.measure("warm-up", url, min_seconds=args.warmup)
        windows.append(warmup)
        await settle(client, admin_token, args.settle)
        before = vm_rss_mib(pid), children_rss_mib(pid)
        print(f"memory before: {before[0]:.1f} MiB (after a {warmup['seconds']:.0f} s warm-up with "
              f"{len(warmup['client']['turns'])} turns)", flush=True)

        async def fields():
            session = (await client.post("/v1/sessions", json={})).json()["id"]
            big = (await client.post("/v1/sessions", json={})).json()["id"]
            await client.post(f"/v1/sessions/{session}/messages", json={"content": "Hello there.", "max_tokens": 8})
            made = (await client.post("/v1/responses", json={"model": model, "input": "Hi.",
                                                              "max_output_tokens": 4})).json()
            ctx = {"session": session, "big_session": big, "response": made["id"], "model": model,
                   "max_chars": args.max_content_chars, "max_body_bytes": args.max_body_mb * 2**20,
                   "long_text": long_text}
            return await probe_fields(client, port, admin_token, ctx, args.verbose)

        probes = {
            "1": ("1 pathological fields", fields, None),
            "2": ("2 invented methods", lambda: probe_methods(client, admin_token, args.methods), None),
            "3": (f"3 slow readers (SEND_TIMEOUT_SECONDS={args.send_timeout:g})",
                  lambda: probe_slow_readers(client, admin_token, port, args.slow_readers, model,
                                             args.slow_reader_max_tokens, args.slow_reader_seconds,
                                             args.send_timeout, service.log_path, args.slow_reader_waves),
                  args.window * args.slow_reader_waves),
            "4": (f"4 slow headers + idle connections (HEADER_TIMEOUT_SECONDS={args.header_timeout:g})",
                  lambda: probe_slow_headers(client, port, args.slow_headers, args.idle_connections, args.window,
                                             args.header_timeout), None),
        }
        parts_before, held_before = rss_parts_mib(pid), await held_in_memory(client, admin_token)
        print(f"heap before: {heap_text(held_before)}", flush=True)
        more_passes = []
        for pass_ in range(1, args.single_passes + 1):  # the first pass counts toward the targets
            pass_rows = []
            for key in args.probes:
                if key not in probes:
                    continue
                label, probe, seconds = probes[key]
                quiet = await harness.measure(f"{label}: quiet", url, min_seconds=seconds)
                await settle(client, admin_token, 1.0)
                print(f"{label}: quiet p95 TTFT {cell(ttft_p95(quiet))} ms ({len(quiet['client']['turns'])} turns)",
                      flush=True)
                during = await harness.measure(label, url, probe, min_seconds=seconds)
                waited = await settle(client, admin_token, 1.0)
                windows += [quiet, during]
                pass_rows.append(probe_row(label, quiet, during))
                r = pass_rows[-1]
                print(f"{label}: {r['requests']} requests, {r['statuses']}; p95 TTFT {cell(r['ttft_p95_during_ms'])} "
                      f"ms ({cell(r['ttft_ratio'], 2)}×); {r['check']['text'] if r['check'] else ''}; "
                      f"{'PASS' if r['passed'] else 'FAIL'} (settled in {waited:.1f} s)", flush=True)
            held = vm_rss_mib(pid)
            cleanup = await delete_everything(client, admin_token)
            await settle(client, admin_token, args.settle)
            if pass_ == 1:
                rows = pass_rows
                after = vm_rss_mib(pid), children_rss_mib(pid)
                parts_after, held_after = rss_parts_mib(pid), await held_in_memory(client, admin_token)
                first_held, first_cleanup = held, cleanup
                print(f"after pass 1: {after[0]:.1f} MiB; heap {heap_text(held_after)}", flush=True)
            else:
                more_passes.append({"pass": pass_, "rss_mib": vm_rss_mib(pid), "rss_parts_mib": rss_parts_mib(pid),
                                    "held": await held_in_memory(client, admin_token), "rows": pass_rows})
                print(f"after pass {pass_}: {more_passes[-1]['rss_mib']:.1f} MiB; heap {heap_text(more_passes[-1]['held'])}",
                      flush=True)
        stats = (await client.get("/v1/admin/tiers", headers=admin)).json()
    peak = max((w["rss_peak_mib"]["server"] for w in windows if w["rss_peak_mib"].get("server")), default=None)
    memory = memory_row("statekeeper serve", before[0], after[0], peak, (before[1], after[1]))
    memory |= {"before_cleanup_mib": first_held, "cleanup": first_cleanup, "held_before": held_before,
               "held_after": held_after, "rss_parts_before_mib": parts_before, "rss_parts_after_mib": parts_after,
               "after_more_passes": more_passes}
    print(f"memory after: {after[0]:.1f} MiB ({first_held:.1f} before deleting the {first_cleanup['conversations']} "
          f"conversations the probes left)", flush=True)
    return {"rows": rows, "memory": [memory], "windows": windows, "final_stats": stats}


def replica_settings(args, admin_token: str, dsn: str, redis_url: str) -> dict:
    """tests/e2e/conftest.py's replicas (lossless, compression off the process), with this run's model and
    deadlines."""
    return {"MODEL": args.model, "MODEL_CACHE_DIR": str(args.model_cache), "DEVICE": "cpu", "TORCH_THREADS": 1,
            "HISTORY_BACKEND": "postgres", "POSTGRES_DSN": dsn, "LEASE_REDIS_URL": redis_url,
            "LEASE_WAIT_SECONDS": 1.0, "REDIS_ENABLED": "true", "REDIS_URL": redis_url, "REDIS_KEY_PREFIX": "abuse:",
            "BLOB_SECRET": "abuse-replica-blob-secret-0123456789abcdef",
            "INDEX_SECRET": "abuse-replica-index-secret-0123456789abcdef",
            "COMPRESSION_POLICY": "none", "COMPRESS_PROCESS": "false", "RESTORE_PLANNING": "false",
            "ADMIN_TOKEN": admin_token, "SEND_TIMEOUT_SECONDS": args.send_timeout,
            "HEADER_TIMEOUT_SECONDS": args.header_timeout}


def replica_phase(args, conn, root: Path, texts: list[str]) -> dict:
    from benchmarks.harness.postgres_server import PostgresServer, missing_reason
    from benchmarks.harness.redis_server import RedisServer
    from benchmarks.harness.replica_server import ReplicaServer, start_all

    reason = missing_reason()
    if reason is not None:
        return {"skipped": reason}
    import redis as redis_client

    postgres = PostgresServer().start()
    redis_server = RedisServer(root / "redis").start()
    admin_token = secrets.token_hex(16)
    started = time.monotonic()
    try:
        settings = replica_settings(args, admin_token, postgres.create_database(), redis_server.url)
        a, b = start_all([ReplicaServer(root / "replica-a", settings), ReplicaServer(root / "replica-b", settings)])
        print(f"replicas up in {time.monotonic() - started:.1f} s (PostgreSQL, Redis, A, B)", flush=True)
        try:
            harness = Harness(conn, {"A": a.process.pid, "B": b.process.pid}, args.window)
            result = asyncio.run(_replica_windows(args, harness, a, b, admin_token, texts))
            keys = redis_client.Redis.from_url(redis_server.url).keys("abuse:*")
            result["redis_keys_left"] = len(keys)
            result["logs"] = {"A": server_errors(a.log_path), "B": server_errors(b.log_path)}
        finally:
            a.stop()
            b.stop()
    finally:
        redis_server.stop()
        postgres.remove()
    return result


async def _replica_windows(args, harness: Harness, a, b, admin_token: str, texts: list[str]) -> dict:
    label = "5 deletes across two replicas"
    async with httpx.AsyncClient(base_url=a.url, timeout=300) as ca, \
            httpx.AsyncClient(base_url=b.url, timeout=300) as cb:
        warmup = await harness.measure("replicas: warm-up", b.url, min_seconds=args.warmup)
        await warm_up_replica_paths(ca, cb, texts, args.delete_batch)
        await settle(cb, admin_token, args.settle)
        before = {n: vm_rss_mib(p) for n, p in harness.pids.items()}
        parts_before = {n: rss_parts_mib(p) for n, p in harness.pids.items()}
        held_before = {"A": await held_in_memory(ca, admin_token), "B": await held_in_memory(cb, admin_token)}
        quiet = await harness.measure(f"{label}: quiet", b.url)
        await settle(cb, admin_token, 1.0)
        print(f"{label}: quiet p95 TTFT {cell(ttft_p95(quiet))} ms ({len(quiet['client']['turns'])} turns)", flush=True)
        during = await harness.measure(label, b.url, lambda: probe_replica_deletes(
            ca, cb, texts, args.delete_rounds, args.delete_batch))
        await settle(ca, admin_token, 1.0)
        await settle(cb, admin_token, 1.0)
        row = probe_row(label, quiet, during)
        print(f"{label}: {row['requests']} requests, {row['statuses']}; p95 TTFT {cell(row['ttft_p95_during_ms'])} "
              f"ms ({cell(row['ttft_ratio'], 2)}×); {row['check']['text']}; {'PASS' if row['passed'] else 'FAIL'}",
              flush=True)
        cleanup = await delete_everything(ca, admin_token)
        await settle(cb, admin_token, args.settle)
        after = {n: vm_rss_mib(p) for n, p in harness.pids.items()}
        parts_after = {n: rss_parts_mib(p) for n, p in harness.pids.items()}
        held_after = {"A": await held_in_memory(ca, admin_token), "B": await held_in_memory(cb, admin_token)}
        repeats = []  # informational: does memory grow again with each pass of the probe, or level off?
        for repeat in range(2, args.replica_passes + 1):
            await probe_replica_deletes(ca, cb, texts, args.delete_rounds, args.delete_batch, seed=repeat)
            await settle(ca, admin_token, 1.0)
            await delete_everything(ca, admin_token)
            await settle(cb, admin_token, args.settle)
            repeats.append({"pass": repeat, "rss_mib": {n: vm_rss_mib(p) for n, p in harness.pids.items()},
                            "rss_parts_mib": {n: rss_parts_mib(p) for n, p in harness.pids.items()}})
            print(f"after pass {repeat} of probe 5: " + ", ".join(
                f"{n} {mib:.1f} MiB" for n, mib in repeats[-1]["rss_mib"].items()), flush=True)
    windows = [warmup, quiet, during]
    memory = []
    for name in ("A", "B"):
        peak = max((w["rss_peak_mib"].get(name) or 0 for w in windows), default=None)
        memory.append(memory_row(f"replica {name}", before[name], after[name], peak, (None, None)) |
                      {"cleanup": cleanup if name == "A" else None,
                       "held_before": held_before[name], "held_after": held_after[name],
                       "rss_parts_before_mib": parts_before[name], "rss_parts_after_mib": parts_after[name],
                       "after_more_passes": [{"pass": r["pass"], "rss_mib": r["rss_mib"][name],
                                              "rss_parts_mib": r["rss_parts_mib"][name]} for r in repeats]})
    return {"rows": [row], "memory": memory, "windows": windows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, a local Hugging Face model directory, or 'tiny' (benchmarks/harness/tiny_model.py, "
                             "built in the run's temporary directory: for development)")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--probes", default="1,2,3,4", type=lambda v: v.split(","), help="which of 1,2,3,4")
    parser.add_argument("--replicas", action="store_true",
                        help="also probe 5: PostgreSQL, Redis and two replicas, after the single server")
    parser.add_argument("--window", type=float, default=15.0, help="seconds of each quiet and probe window (at least)")
    parser.add_argument("--warmup", type=float, default=12.0, help="seconds of the warm-up window")
    parser.add_argument("--settle", type=float, default=12.0,
                        help="seconds after the last turn before memory is read (the service gives freed memory "
                             "back once quiet for GIVE_BACK_MEMORY_AFTER_SECONDS, 10 by default, at its next sweep)")
    parser.add_argument("--users", type=int, default=2, help="the well-behaved client's concurrent users")
    parser.add_argument("--rounds", type=int, default=4, help="turns per conversation of a well-behaved user")
    parser.add_argument("--max-tokens", type=int, default=32, help="the well-behaved client's max_tokens")
    parser.add_argument("--max-chars", type=int, default=1500, help="its ShareGPT messages are cut to this many")
    parser.add_argument("--send-timeout", type=float, default=3.0, help="the server's SEND_TIMEOUT_SECONDS")
    parser.add_argument("--header-timeout", type=float, default=3.0, help="the server's HEADER_TIMEOUT_SECONDS")
    parser.add_argument("--max-connections", type=int, default=1000, help="the server's MAX_CONNECTIONS")
    parser.add_argument("--max-content-chars", type=int, default=32000, help="the server's MAX_CONTENT_CHARS")
    parser.add_argument("--max-body-mb", type=int, default=8, help="the server's MAX_BODY_MB")
    parser.add_argument("--methods", type=int, default=200, help="probe 2: requests with invented methods")
    parser.add_argument("--slow-readers", type=int, default=8, help="probe 3: sockets that never read")
    parser.add_argument("--slow-reader-seconds", type=float, default=40.0,
                        help="probe 3: the longest it waits for the server to drop them before closing them itself")
    parser.add_argument("--slow-reader-waves", type=int, default=3,
                        help="probe 3: waves of --slow-readers, one after the other (its quiet window and its own "
                             "last at least --window seconds a wave, so the p95 has more than one wave's turns)")
    parser.add_argument("--slow-reader-max-tokens", type=int, default=None,
                        help="probe 3: max_tokens of their completions (default: left out, all the context has room "
                             "for up to MAX_TOKENS_LIMIT)")
    parser.add_argument("--slow-headers", type=int, default=8, help="probe 4: sockets sending headers a byte a second")
    parser.add_argument("--idle-connections", type=int, default=None,
                        help="probe 4: connections that send nothing (default MAX_CONNECTIONS - 100)")
    parser.add_argument("--delete-rounds", type=int, default=6, help="probe 5: rounds")
    parser.add_argument("--single-passes", type=int, default=1,
                        help="the single server's probes again, N passes in all, its memory read after each pass's "
                             "cleanup (whether it levels off or grows per pass); only the first counts toward the targets")
    parser.add_argument("--replica-passes", type=int, default=1,
                        help="probe 5 run this many times, each replica's memory read after each (only the first "
                             "pass counts toward the targets; the others show whether memory levels off)")
    parser.add_argument("--delete-batch", type=int, default=4, help="probe 5: conversations per round")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="another setting for the server (repeatable), e.g. STATEKEEPER_LONG_PREFILL_LANE=off")
    parser.add_argument("--json", help="write the raw results here")
    parser.add_argument("--verbose", action="store_true", help="print each request of probe 1 as it goes")
    args = parser.parse_args()
    if args.idle_connections is None:
        args.idle_connections = max(0, args.max_connections - 100)

    header = machine_record()
    command = "python -m benchmarks.abuse " + shlex.join(sys.argv[1:])
    conversations = pick_conversations(max(8, args.users * 4), args.rounds, args.max_chars)
    texts = [m for c in conversations for m in c]
    long_text = ""
    for conversation in sharegpt_conversations():
        long_text += "\n\n".join(content for _, content in conversation) + "\n\n"
        if len(long_text) > args.max_content_chars + 10:
            break

    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    client = context.Process(target=well_behaved_process, args=(child_conn, conversations, args.users, args.max_tokens),
                             daemon=True)
    client.start()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "machine": header, "args": vars(args) | {"model_cache": str(args.model_cache)}}
    try:
        with tempfile.TemporaryDirectory(prefix="statekeeper-abuse-") as root:
            root = Path(root)
            if args.model == "tiny":
                from benchmarks.harness.tiny_model import make_tiny_model_dir
                args.model = str(make_tiny_model_dir(root / "tiny-model"))
            admin_token = secrets.token_hex(16)
            env = {"STATEKEEPER_MODEL": args.model, "STATEKEEPER_MODEL_CACHE_DIR": str(args.model_cache),
                   "STATEKEEPER_TORCH_THREADS": "1", "STATEKEEPER_ADMIN_TOKEN": admin_token,
                   "STATEKEEPER_SEND_TIMEOUT_SECONDS": f"{args.send_timeout:g}",
                   "STATEKEEPER_HEADER_TIMEOUT_SECONDS": f"{args.header_timeout:g}",
                   "STATEKEEPER_MAX_CONNECTIONS": str(args.max_connections),
                   "STATEKEEPER_MAX_CONTENT_CHARS": str(args.max_content_chars),
                   "STATEKEEPER_MAX_BODY_MB": str(args.max_body_mb)}
            env |= dict(setting.split("=", 1) for setting in args.server_env)
            (root / "single").mkdir()
            service = ServiceProcess(root / "single", env)
            start_s = service.start()
            print(f"service up in {start_s:.1f} s (model {args.model})", flush=True)
            try:
                harness = Harness(conn, {"server": service.process.pid}, args.window)
                single = asyncio.run(single_server(args, harness, service, admin_token, long_text))
            finally:
                single_log = server_errors(service.log_path)
                stop_s = service.stop()
                log_copy = (service.log_path.read_text(errors="replace") if service.log_path.exists() else "")
            report["single"] = single | {"start_s": start_s, "stop_s": stop_s, "server_log_errors": single_log}
            if args.json:
                Path(args.json).with_suffix(".server.log").write_text(log_copy)
            rows, memory = list(single["rows"]), list(single["memory"])
            if args.replicas:
                replicas = replica_phase(args, conn, root, texts)
                report["replicas"] = replicas
                if "skipped" in replicas:
                    print(f"probe 5 skipped: {replicas['skipped']}", flush=True)
                else:
                    rows += replicas["rows"]
                    memory += replicas["memory"]
    finally:
        conn.send(None)
        client.join(10)

    passed = all(r["passed"] for r in rows) and all(m["passed"] for m in memory)
    table = markdown(rows, memory)
    settings = (f"SEND_TIMEOUT_SECONDS={args.send_timeout:g}, HEADER_TIMEOUT_SECONDS={args.header_timeout:g} "
                f"(production defaults 30 and 10), MAX_CONNECTIONS={args.max_connections}, "
                f"MAX_CONTENT_CHARS={args.max_content_chars}, MAX_BODY_MB={args.max_body_mb}, TORCH_THREADS=1")
    print(f"\ncommand: {command}")
    print(f"machine: {header['line']}{' (with uncommitted changes)' if 'uncommitted' in header['commit'] else ''}; "
          f"load average at start {' '.join(header['loadavg'])}")
    print(f"model: {args.model}; server: {settings}")
    print(f"other users: {args.users} well-behaved users (ShareGPT, {args.rounds} turns a conversation, streamed, "
          f"max_tokens {args.max_tokens}, think {THINK_SECONDS[0]}–{THINK_SECONDS[1]} s); windows ≥ {args.window:g} s\n")
    print(table)
    print(f"\noverall: {'PASS' if passed else 'FAIL'} (targets: no status ≥ 500; p95 TTFT during a probe ≤ "
          f"{TTFT_LIMIT:g}× quiet; VmRSS after ≤ {1 + MEMORY_LIMIT:g}× before; each probe's check)")
    unexpected = [c for w in report["single"]["windows"] if w.get("probe") and "cases" in w["probe"]
                  for c in w["probe"]["cases"] if c["unexpected"]]
    if unexpected:
        print("\nprobe 1 answers other than the README's (informational):")
        for c in unexpected:
            print(f"  {c['name']}: {c.get('status')} (expected {'/'.join(map(str, c['expect']))})"
                  f"{' ' + c['error'] if c.get('error') else ''}")
    for r in rows:
        if r["slowest_turns"] and r["slowest_turns"][0]["meanwhile"]:
            print(f"\nslowest other-user first tokens during probe {r['probe']}:")
            for t in r["slowest_turns"]:
                print(f"  {t['ttft_ms']:,.0f} ms (round {t['round']}, {t['chars']} characters) while: "
                      f"{'; '.join(t['meanwhile']) or 'no probe request'}")
    for line in report["single"]["server_log_errors"][:20]:
        print("server log:", line)
    report |= {"rows": rows, "memory": memory, "passed": passed, "markdown": table}
    if args.json:
        write_json(args.json, report, machine=header)


if __name__ == "__main__":
    main()
