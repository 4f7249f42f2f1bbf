"""kill -9 at random moments under multi-user load (issue 14): is an acknowledged turn ever lost, is a
corrupt KV blob ever served after the restart, and how long does the restart take?

    chrt --idle 0 ionice -c 3 python -m benchmarks.crash --trials 100 --users 4 --json crash.json

One data directory is kept across all trials, as in production. Each trial (re)starts `statekeeper serve`
in a process group of its own (restart time: from the process start to /healthz answering 200), lets
--users concurrent users talk to it for a random --min-seconds..--max-seconds, then SIGKILLs the whole
group (the service, its compression child, multiprocessing's resource tracker) at that moment: mid-turn,
mid-offload, mid-demotion and mid-compression all happen. The settings keep every moment busy: a small
active KV budget and a short idle offload (states go to storage all the time), a small DRAM tier (blobs
demote into LMDB and on into the SSD tier), a short compress-after (the child re-encodes stored blobs
while the users talk).

Each user replays real ShareGPT user messages (cut to --max-chars), greedy, --max-tokens per reply, after
0.1-0.5 s of think time; now and then it reads its conversation first (GET .../messages, which promotes
the blob) or offloads it after the reply (POST .../offload). A session ends after its 3-8 planned
rounds or near --max-session-tokens and the user starts a new one; every other new session is lossless
({"compression": {"policy": "none", "codec": "none"}}), the rest use the service default (compressed
later). Users carry their sessions over to the next trial, so each restart also resumes conversations
whose state was stored before the kill.

A turn is acknowledged once its client got the final `done` event (the service commits the history
before it sends that event). After each kill, with the service down, the benchmark opens the data
directory in-process with statekeeper.assembly.build_service (as tests/statekeeper/test_crash_safety.py
does; this reconciles the tiers exactly as the service's own start would) and checks:

  lost turns            every acknowledged turn of every session the clients ever created is in the
                        history, in order, with the same user message and reply text. The one turn per
                        session that was in flight at the kill may be there or not (both counted), and
                        nothing else may be (a turn in the history that no client sent).
  corrupt blobs served  every stored blob that changed since the last check (whole-blob xxh3) goes through
                        the service's own loader (BlobLoader.load with plan=False: every stored token,
                        all validation included) and what it accepts is compared with a fresh prefill of
                        the same tokens by one model copy loaded for the whole run:
                          exact blobs (no meta): every K and V element within 1e-3 (abs + rel); honest
                            ones measured <= 4e-5 (incremental decode vs one prefill), a wrong token or a
                            shift by one position differs by > 10;
                          lossy blobs (compressed, or the exact copy of a state restored from a compressed
                            one, which carries its attention bias): loader.load gives dense K/V with the
                            evicted entries zeroed and a per-head bias of -inf on them, so only the kept
                            (head, token) rows are compared, by cosine similarity (the lower of K's and
                            V's). Layer 0's K and V depend only on the token and its position, not on the
                            (lossy) history, so there every kept row must reach 0.9: honest blobs measured
                            >= 0.993 (int4 error alone), one wrong token <= 0.16, a shift by one position
                            or another conversation's tokens < 0. Deeper layers of a state restored and
                            extended several times drift (each later token was computed over a lossy
                            history), so there at most 25% of a layer's kept rows may fall below 0.5:
                            honest blobs measured <= 3.3%, shifted or foreign ones >= 87%. (Measured with
                            the service default, per-head KVzip eviction at 0.5 and int4-rot-g32-s1, on
                            SmolLM2-135M; other compression settings would need their own limits.)
                          a lossless session's blob must be exact.
                        A blob the loader refuses (format, model, token digest, checksum) is counted
                        apart: it is discarded and the turn recomputes, which is the designed behaviour.
                        Refused blobs are deleted by that load, as the service's next restore would.

After the last trial the service is started once more, one turn is sent on each user's session, the
service is stopped gracefully and everything is checked once more. The exit status is 1 if an
acknowledged turn was lost, a corrupt blob was served, or the history holds a turn no client sent. The
data directory and the service logs (one per trial) are kept when that happens, or with --data-dir.

A turn's reply text is needed for the check, which multiround.send_turn does not keep, hence
stream_turn here."""

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
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import torch
import xxhash

from benchmarks.multiround import LOSSLESS, Config, ServiceProcess, service_env
from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.history import HistoryStore
from statekeeper.model_loader import load_model
from statekeeper.assembly import build_service
from statekeeper.sessions.restore import LoadedKV
from statekeeper.settings import Settings
from statekeeper.worker import ModelWorker

THINK_SECONDS = (0.1, 0.5)
ROUNDS = (3, 8)  # planned user turns per session
REQUEST_TIMEOUT_S = 120.0  # a request that takes longer is an error (not a hang)
START_TIMEOUT_S = 300.0
FINAL_MESSAGE = "Thanks. Could you sum that up in one sentence?"
# The limits a served blob must keep to, measured in the module docstring.
EXACT_TOLERANCE = 1e-3  # exact blobs: abs and rel, every element
LAYER0_MIN_COSINE = 0.9  # lossy blobs: every kept row of layer 0, K and V
LOW_COSINE = 0.5  # lossy blobs, any layer: at most MAX_LOW_SHARE of the kept rows below this
MAX_LOW_SHARE = 0.25


# -- the service under test ------------------------------------------------------------------------


class KillableService(ServiceProcess):
    """`statekeeper serve` in its own process group, so one SIGKILL reaches the compression child too."""

    def __init__(self, data_dir: Path, env: dict[str, str], log_path: Path):
        super().__init__(data_dir, env, own_process_group=True, poll_seconds=0.05)
        self.log_path = log_path  # one log per trial, kept next to the data directory

    def kill(self) -> None:
        """SIGKILL to every process of the group; also cleans up after a stop (or a kill) that already ran."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):  # none of the group is left
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._wait_until_group_gone()

    def _wait_until_group_gone(self, timeout_s: float = 30.0) -> None:
        """The children are not ours to reap: wait until none of the group is alive (zombies aside), so
        nothing of the killed service still runs while the check opens its data directory."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not live_group_members(self.process.pid):
                return
            time.sleep(0.05)
        raise RuntimeError(f"process group {self.process.pid} still alive {timeout_s:.0f} s after SIGKILL")


def live_group_members(pgid: int) -> list[int]:
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(int(stat.parent.name))
    return members


def crash_env(args: argparse.Namespace, admin_token: str) -> dict[str, str]:
    tiers = {"STATEKEEPER_DRAM_BUDGET_MB": str(args.dram_budget_mb),
             "STATEKEEPER_LMDB_BUDGET_MB": str(args.lmdb_budget_mb),
             "STATEKEEPER_SSD_ENABLED": "true", "STATEKEEPER_SSD_BUDGET_MB": str(args.ssd_budget_mb)}
    return service_env(Config("crash", tiers, None), args, admin_token)


def service_settings(env: dict[str, str], data_dir: Path) -> Settings:
    """The settings the service builds from `env` (and the same process environment), for the check."""
    fields = {name.removeprefix("STATEKEEPER_").lower(): value for name, value in env.items()}
    return Settings(**fields, data_dir=data_dir)


# -- what the clients know -------------------------------------------------------------------------


@dataclass
class Ledger:
    """One session as its client knows it: the turns it got a reply for, in order."""

    id: str
    lossless: bool
    messages: list[str]  # the user messages planned for it
    acked: list[tuple[str, str]] = field(default_factory=list)  # (user message, reply text)
    in_flight: str | None = None  # sent, no reply (the kill, or an error): committed or not, the check says
    tokens: int = 0
    abandoned: bool = False  # an error the kill did not cause: no more turns on it
    broken: bool = False  # the check found it wrong: reported once, then left alone

    def is_finished(self, max_tokens: int) -> bool:
        # A turn adds up to ~250 tokens (a 600-character message, the template, the reply).
        return (self.abandoned or self.broken or len(self.acked) >= len(self.messages)
                or self.tokens + 250 > max_tokens)

    def next_message(self) -> str:
        return self.messages[len(self.acked)]  # a message whose turn was not committed is sent again


@dataclass
class User:
    index: int
    rng: random.Random
    conversations: Iterator[list[str]]
    session: Ledger | None = None


@dataclass
class Workload:
    users: list[User]
    ledgers: list[Ledger] = field(default_factory=list)
    sessions_created: int = 0


def conversations(first: int, every: int, max_chars: int) -> Iterator[list[str]]:
    """Endless: user i takes ShareGPT conversations i, i + N, ... (as their user messages)."""
    while True:
        for number, conversation in enumerate(sharegpt_conversations(min_turns=ROUNDS[0])):
            if number % every == first:
                yield [content[:max_chars] for role, content in conversation if role == "user"]


def new_workload(args: argparse.Namespace) -> Workload:
    return Workload([User(i, random.Random(args.seed * 1000 + i), conversations(i, args.users, args.max_chars))
                     for i in range(args.users)])


@dataclass
class TrialLog:
    """What the clients saw during one trial."""

    killed: bool = False
    acked: int = 0
    offloads: int = 0
    reads: int = 0
    sessions_created: int = 0
    sources: Counter = field(default_factory=Counter)  # restore source of each acknowledged turn
    cut_by_kill: Counter = field(default_factory=Counter)  # requests in flight when the kill came, by kind
    errors: list[dict] = field(default_factory=list)  # errors the kill did not cause
    touched: set[str] = field(default_factory=set)
    admin: dict | None = None  # GET /v1/admin/tiers just before the kill

    def failed(self, kind: str, error: str, by_service: bool = False) -> None:
        """A transport error after the kill is the kill's doing; an answer from the service never is."""
        if self.killed and not by_service:
            self.cut_by_kill[kind] += 1
        else:
            self.errors.append({"kind": kind, "error": error[:300], "after_kill": self.killed})


# -- the users -------------------------------------------------------------------------------------


@dataclass
class TurnReply:
    text: str = ""
    source: str = ""
    tokens: int = 0
    error: str | None = None
    by_service: bool = False  # the service answered with the error (a status or an error event)


async def stream_turn(client: httpx.AsyncClient, session_id: str, content: str, max_tokens: int) -> TurnReply:
    body = {"content": content, "max_tokens": max_tokens, "stream": True}  # temperature 0: greedy
    final = None
    try:
        async with client.stream("POST", f"/v1/sessions/{session_id}/messages", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return TurnReply(error=f"HTTP {response.status_code}: {text}", by_service=True)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return TurnReply(error=f"mid-stream: {event['error']}", by_service=True)
                if event.get("done"):
                    final = event
    except (httpx.HTTPError, ValueError) as exc:  # ValueError: an event cut off by the kill
        return TurnReply(error=repr(exc))
    if final is None:
        return TurnReply(error="stream ended without a result")
    usage = final["usage"]
    return TurnReply(final["content"], final["restore"]["source"], usage["prompt_tokens"] + usage["completion_tokens"])


async def plain_request(client: httpx.AsyncClient, method: str, path: str, kind: str, log: TrialLog,
                        **kwargs) -> httpx.Response | None:
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.HTTPError as exc:
        log.failed(kind, repr(exc))
        return None
    if response.status_code not in (200, 201):
        log.failed(kind, f"HTTP {response.status_code}: {response.text}", by_service=True)
        return None
    return response


async def create_session(client: httpx.AsyncClient, workload: Workload, user: User, log: TrialLog) -> Ledger | None:
    lossless = workload.sessions_created % 2 == 0
    workload.sessions_created += 1
    messages = next(user.conversations)[: user.rng.randint(*ROUNDS)]
    response = await plain_request(client, "POST", "/v1/sessions", "create", log,
                                   json={"compression": LOSSLESS} if lossless else {})
    if response is None:
        return None
    ledger = Ledger(response.json()["id"], lossless, messages)
    workload.ledgers.append(ledger)
    log.sessions_created += 1
    return ledger


async def take_turn(client: httpx.AsyncClient, ledger: Ledger, max_tokens: int, log: TrialLog) -> bool:
    content = ledger.next_message()
    ledger.in_flight = content
    reply = await stream_turn(client, ledger.id, content, max_tokens)
    if reply.error is not None:
        log.failed("turn", reply.error, reply.by_service)
        ledger.abandoned = ledger.abandoned or not log.killed or reply.by_service
        return False
    ledger.acked.append((content, reply.text))
    ledger.in_flight, ledger.tokens = None, reply.tokens
    log.acked += 1
    log.sources[reply.source] += 1
    return True


async def run_user(client: httpx.AsyncClient, workload: Workload, user: User, args, log: TrialLog) -> None:
    """Turns until the kill; never starts a request after it."""
    while not log.killed:
        if user.session is None or user.session.is_finished(args.max_session_tokens):
            user.session = await create_session(client, workload, user, log)
            if user.session is None:
                await asyncio.sleep(1.0)  # an error, not the kill: do not spin on it
                continue
        ledger = user.session
        log.touched.add(ledger.id)
        await asyncio.sleep(user.rng.uniform(*THINK_SECONDS))
        if not log.killed and user.rng.random() < args.read_probability:
            # What a UI does when the user opens the chat; the service promotes the blob meanwhile.
            if await plain_request(client, "GET", f"/v1/sessions/{ledger.id}/messages", "read", log):
                log.reads += 1
        if log.killed:
            return
        if await take_turn(client, ledger, args.max_tokens, log) and not log.killed \
                and user.rng.random() < args.offload_probability:
            if await plain_request(client, "POST", f"/v1/sessions/{ledger.id}/offload", "offload", log):
                log.offloads += 1


async def load_then_kill(service: KillableService, workload: Workload, args, seconds: float,
                         admin_token: str) -> TrialLog:
    log = TrialLog()
    async with httpx.AsyncClient(base_url=service.url, timeout=REQUEST_TIMEOUT_S) as client:
        users = [asyncio.create_task(run_user(client, workload, user, args, log)) for user in workload.users]
        await asyncio.sleep(seconds)
        log.admin = await admin_stats(client, admin_token)
        log.killed = True  # before the kill: every transport error seen from now on is the kill's
        service.kill()
        done, stuck = await asyncio.wait(users, timeout=REQUEST_TIMEOUT_S)
    for task in stuck:
        task.cancel()
    for task in done:
        task.result()  # a bug in this benchmark surfaces here
    if stuck:
        raise RuntimeError(f"{len(stuck)} users still waiting {REQUEST_TIMEOUT_S:.0f} s after the kill")
    return log


async def admin_stats(client: httpx.AsyncClient, admin_token: str) -> dict | None:
    try:
        response = await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"}, timeout=5)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


# -- the check, with the service down --------------------------------------------------------------


def turn_pairs(messages: list[dict]) -> list[tuple[str, str]]:
    """(user, assistant) contents in order; anything out of that pattern shows up as a mismatch."""
    pairs = []
    for user, assistant in zip(messages[0::2], messages[1::2]):
        if user["role"] != "user" or assistant["role"] != "assistant":
            pairs.append((f"<{user['role']}> {user['content']}", f"<{assistant['role']}> {assistant['content']}"))
        else:
            pairs.append((user["content"], assistant["content"]))
    return pairs


def check_history(history: HistoryStore, ledgers: list[Ledger], trial: int) -> tuple[Counter, list[dict]]:
    """Every acknowledged turn is in the history; settles the turns that were in flight."""
    counts, findings = Counter(), []
    for ledger in ledgers:
        if ledger.broken:
            continue
        conversation = history.load(ledger.id)
        found = [] if conversation is None else turn_pairs(conversation.messages)
        lost = [i for i, turn in enumerate(ledger.acked) if i >= len(found) or found[i] != turn]
        if lost:
            counts["lost_turns"] += len(lost)
            findings.append(lost_turn_finding(ledger, found, lost, trial))
            ledger.broken = True
            continue
        extra = found[len(ledger.acked):]
        if ledger.in_flight is not None:
            committed = bool(extra) and extra[0][0] == ledger.in_flight
            counts["in_flight_committed" if committed else "in_flight_not_committed"] += 1
            if committed:
                ledger.acked.append(extra.pop(0))
            ledger.in_flight = None
        if extra:
            counts["unsent_turns"] += len(extra)
            findings.append({"problem": "turns in the history that no client sent", "session": ledger.id,
                             "trial": trial, "acked": len(ledger.acked), "extra": extra[:3]})
            ledger.broken = True
        ledger.tokens = len(conversation.tokens) if conversation else 0
    return counts, findings


def lost_turn_finding(ledger: Ledger, found: list, lost: list[int], trial: int) -> dict:
    first = lost[0]
    return {"problem": "acknowledged turns lost", "session": ledger.id, "trial": trial, "turns": lost,
            "acked": len(ledger.acked), "in_history": len(found), "lossless": ledger.lossless,
            "expected": ledger.acked[first], "found": found[first] if first < len(found) else None}


@dataclass
class BlobVerdict:
    kind: str  # exact | lossy
    ok: bool
    measures: dict[str, float]
    note: str = ""


def compare_with_recompute(worker: ModelWorker, loaded: LoadedKV, tokens: list[int], lossless: bool) -> BlobVerdict:
    cache = loaded.cache
    reference = worker.new_cache()
    worker.prefill(reference, tokens[: cache.num_tokens])
    pairs = [(a, b) for (k, v), (rk, rv) in zip(cache.export_layers(), reference.export_layers())
             for a, b in ((k, rk), (v, rv))]
    if not loaded.meta:
        difference = max((a - b).abs().max().item() for a, b in pairs)
        ok = all(torch.allclose(a, b, rtol=EXACT_TOLERANCE, atol=EXACT_TOLERANCE) for a, b in pairs)
        return BlobVerdict("exact", ok, {"max_difference": difference})
    measures = lossy_measures(cache, pairs)
    ok = measures["layer0_min_cosine"] >= LAYER0_MIN_COSINE and measures["max_low_share"] <= MAX_LOW_SHARE
    if lossless:
        return BlobVerdict("lossy", False, measures, "a lossy blob for a lossless session")
    return BlobVerdict("lossy", ok, measures)


def lossy_measures(cache, pairs: list) -> dict[str, float]:
    """Cosine similarity of each kept (head, token) row to the recompute, the lower of K's and V's.
    Layer 0's K and V depend only on the token and its position, never on the (lossy) history, so there
    only int4 error is allowed; deeper layers may drift further (see the module docstring)."""
    layer0_min, low_share = 1.0, 0.0
    for layer in range(len(pairs) // 2):
        (k, rk), (v, rv) = pairs[2 * layer], pairs[2 * layer + 1]
        kept = torch.ones(k.shape[:2], dtype=torch.bool)
        if cache.head_bias is not None:
            kept = torch.isfinite(cache.head_bias[layer][:, : k.shape[1]])  # -inf: evicted
        if not kept.any():
            continue
        cosines = torch.minimum(torch.cosine_similarity(k[kept], rk[kept], dim=-1),
                                torch.cosine_similarity(v[kept], rv[kept], dim=-1))
        if layer == 0:
            layer0_min = cosines.min().item()
        low_share = max(low_share, (cosines < LOW_COSINE).float().mean().item())
    return {"layer0_min_cosine": layer0_min, "max_low_share": low_share}


def worst_of(extremes: dict, measures: dict) -> dict:
    """The worst value of each measure: the largest difference or share, the lowest cosine."""
    pick = {key: min if "cosine" in key else max for key in measures}
    return extremes | {key: pick[key](value, extremes.get(key, value)) for key, value in measures.items()}


def blob_digest(tiers, session: str) -> str | None:
    with tiers.read(session) as (_, blob):
        return None if blob is None else xxhash.xxh3_64_hexdigest(blob)


def tier_errors(service) -> int:
    return sum(stats["errors"] for stats in service.tiers.stats())


class Checker:
    """Opens the data directory as the service's start would, with the one model copy of this run."""

    def __init__(self, env: dict[str, str], data_dir: Path):
        config = service_settings(env, data_dir).to_config()
        config.sessions.compress_process = False  # the check compresses nothing: no child process
        config.restore_planning = False  # and needs no restore profile (it loads every stored token)
        self.config = config
        w = config.worker
        self.worker = ModelWorker(load_model(w.model, w.model_cache_dir, w.device, w.dtype), w)
        self.verdicts: dict[tuple[str, str], bool] = {}  # (session, blob xxh3) -> served and sound

    def check(self, workload: Workload, touched: set[str], trial: int) -> dict:
        started = time.perf_counter()
        service = build_service(self.config, self.worker)
        try:
            counts, findings = check_history(service.history, workload.ledgers, trial)
            counts["dram_blobs_lost"] = service.tiers.missing_at_start  # index entries of DRAM blobs
            worst = self.check_blobs(service, touched, trial, counts, findings)
        finally:
            service.close()
        return {"counts": counts, "findings": findings, "worst": worst, "check_s": time.perf_counter() - started}

    def check_blobs(self, service, touched: set[str], trial: int, counts: Counter, findings: list) -> dict:
        extremes = {}
        errors_before = tier_errors(service)
        sound = set()  # sessions whose stored blob the loader accepts and that matches a recompute
        for session in sorted(service.tiers.keys()):
            digest = blob_digest(service.tiers, session)
            if digest is None:
                continue
            if (session, digest) not in self.verdicts:  # an unchanged blob was checked before
                verdict = self.verify(service, session, counts)
                self.verdicts[(session, digest)] = verdict is not None and verdict.ok
                if verdict is not None:
                    extremes = worst_of(extremes, verdict.measures)
                    if not verdict.ok:
                        findings.append({"problem": "corrupt blob served", "session": session, "trial": trial,
                                         **asdict(verdict)})
            if self.verdicts[(session, digest)]:
                sound.add(session)
        counts["touched_restorable"] += len(touched & sound)
        counts["touched_recompute"] += len(touched - sound)
        counts["refused"] += tier_errors(service) - errors_before
        return extremes

    def verify(self, service, session: str, counts: Counter) -> BlobVerdict | None:
        conversation = service.history.load(session)
        if conversation is None:  # the start-up reconciliation deletes such orphans: not reached
            return None
        loaded = service.loader.load(session, conversation.tokens, plan=False)  # refusals count as tier errors
        if loaded is None or loaded.cache.num_tokens == 0:
            return None
        lossless = service.compression.of(conversation.compression).is_lossless
        verdict = compare_with_recompute(self.worker, loaded, conversation.tokens, lossless)
        counts[f"{verdict.kind}_blobs_checked"] += 1
        counts["corrupt_served"] += not verdict.ok
        return verdict


# -- the run ---------------------------------------------------------------------------------------


def wait_while(path: str | None) -> None:
    """Between trials (the service down): another benchmark asked for a quiet machine."""
    while path and os.path.exists(path):
        time.sleep(30)


def run_trial(number: int, workload: Workload, checker: Checker, env: dict, paths: dict, args,
              rng: random.Random, admin_token: str) -> dict:
    service = KillableService(paths["data"], env, paths["logs"] / f"serve-{number:03d}.log")
    try:
        start_s = service.start(START_TIMEOUT_S)
        seconds = rng.uniform(args.min_seconds, args.max_seconds)
        log = asyncio.run(load_then_kill(service, workload, args, seconds, admin_token))
    finally:
        service.kill()  # also after an error before the kill: leave nothing behind
    checked = checker.check(workload, log.touched, number)
    return {"trial": number, "start_s": start_s, "load_s": seconds, "acked": log.acked, "offloads": log.offloads,
            "reads": log.reads, "sessions_created": log.sessions_created, "sources": dict(log.sources),
            "cut_by_kill": dict(log.cut_by_kill), "errors": log.errors, "touched": len(log.touched),
            "compression": (log.admin or {}).get("compression"), "tiers": (log.admin or {}).get("tiers"),
            "service_log_warnings": log_lines(service.log_path, (" WARNING ", " ERROR ")),
            **checked, "counts": dict(checked["counts"])}


async def one_more_turn_each(service: KillableService, workload: Workload, max_tokens: int) -> TrialLog:
    log = TrialLog()
    async with httpx.AsyncClient(base_url=service.url, timeout=REQUEST_TIMEOUT_S) as client:
        for user in workload.users:
            ledger = user.session
            if ledger is None or ledger.broken or ledger.abandoned:
                continue
            if len(ledger.acked) >= len(ledger.messages):
                ledger.messages.append(FINAL_MESSAGE)
            log.touched.add(ledger.id)
            await take_turn(client, ledger, max_tokens, log)
    return log


def final_round(workload: Workload, checker: Checker, env: dict, paths: dict, args) -> dict:
    """After the last kill: the restart serves a turn on each user's session and stops gracefully."""
    service = KillableService(paths["data"], env, paths["logs"] / "serve-final.log")
    try:
        start_s = service.start(START_TIMEOUT_S)
        log = asyncio.run(one_more_turn_each(service, workload, args.max_tokens))
        stop_s = service.stop()
    finally:
        service.kill()  # whatever of the group outlived the stop, before the check opens the directory
    checked = checker.check(workload, log.touched, args.trials)
    return {"start_s": start_s, "stop_s": stop_s, "turns": len(log.touched), "acked": log.acked,
            "errors": log.errors, "sources": dict(log.sources), **checked, "counts": dict(checked["counts"])}


def log_lines(path: Path, markers: tuple[str, ...], keep: int = 5) -> dict:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if any(m in line for m in markers)]
    except OSError:
        return {"count": 0, "first": []}
    return {"count": len(lines), "first": [line[:300] for line in lines[:keep]]}


# -- the report ------------------------------------------------------------------------------------


def total(rows: list[dict], key: str) -> int:
    return sum(row["counts"].get(key, 0) for row in rows)


def summarize(trials: list[dict], final: dict) -> dict:
    rows = trials + [final]
    restarts = [t["start_s"] for t in trials[1:]] + [final["start_s"]]  # every start after a kill
    cut = Counter()
    for trial in trials:
        cut.update(trial["cut_by_kill"])
    sources = Counter()
    for row in rows:
        sources.update(row["sources"])
    worst = {}
    for row in rows:
        worst = worst_of(worst, row["worst"])
    return {
        "trials": len(trials),
        "acked_turns": sum(t["acked"] for t in trials) + final["acked"],
        "lost_turns": total(rows, "lost_turns"),
        "corrupt_served": total(rows, "corrupt_served"),
        "unsent_turns": total(rows, "unsent_turns"),
        "refused": total(rows, "refused"),
        "exact_blobs_checked": total(rows, "exact_blobs_checked"),
        "lossy_blobs_checked": total(rows, "lossy_blobs_checked"),
        "worst": worst,
        "in_flight_committed": total(rows, "in_flight_committed"),
        "in_flight_not_committed": total(rows, "in_flight_not_committed"),
        "cut_by_kill": dict(cut),
        "errors": sum(len(row["errors"]) for row in rows),
        "touched_restorable": total(trials, "touched_restorable"),
        "touched_recompute": total(trials, "touched_recompute"),
        "dram_blobs_lost": total(trials, "dram_blobs_lost"),
        "sources": dict(sources),
        "offloads": sum(t["offloads"] for t in trials),
        "reads": sum(t["reads"] for t in trials),
        "sessions_created": sum(t["sessions_created"] for t in trials),
        "compressed": sum(((t["compression"] or {}).get("compressed") or 0) for t in trials),
        "trials_compressing": sum(1 for t in trials if ((t["compression"] or {}).get("process_jobs") or 0) > 0),
        "first_start_s": trials[0]["start_s"] if trials else None,
        "restart_p50_s": percentile(restarts, 0.5),
        "restart_p95_s": percentile(restarts, 0.95),
        "restart_max_s": max(restarts, default=None),
        "load_mean_s": statistics.mean(t["load_s"] for t in trials) if trials else None,
        "check_mean_s": statistics.mean(t["check_s"] for t in trials) if trials else None,
        "check_max_s": max((t["check_s"] for t in trials), default=None),
        "final_turns": f"{final['acked']}/{final['turns']}",
        "service_log_warnings": sum(t["service_log_warnings"]["count"] for t in trials),
    }


def cell(value, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:,.{digits}f}" if isinstance(value, float) else str(value)


def summary_table(s: dict) -> str:
    cut = ", ".join(f"{kind} {n}" for kind, n in sorted(s["cut_by_kill"].items())) or "0"
    sources = ", ".join(f"{source} {n}" for source, n in sorted(s["sources"].items())) or "—"
    worst = s["worst"]
    rows = [
        ("trials (kill -9 each)", s["trials"]),
        ("acknowledged turns", s["acked_turns"]),
        ("**lost turns** (goal 0)", s["lost_turns"]),
        ("**corrupt blobs served** (goal 0)", s["corrupt_served"]),
        ("turns in the history no client sent", s["unsent_turns"]),
        ("blobs refused at restore (discarded, recomputed)", s["refused"]),
        ("blobs checked against a recompute: exact / lossy",
         f"{s['exact_blobs_checked']} / {s['lossy_blobs_checked']}"),
        (f"exact blobs: largest difference to the recompute (limit {EXACT_TOLERANCE:g})",
         cell(worst.get("max_difference"), 6)),
        (f"lossy blobs: lowest layer-0 row cosine (limit {LAYER0_MIN_COSINE:g}) / largest share of a layer's "
         f"rows below {LOW_COSINE:g} (limit {MAX_LOW_SHARE:g})",
         f"{cell(worst.get('layer0_min_cosine'), 4)} / {cell(worst.get('max_low_share'), 4)}"),
        ("turns in flight at the kill: committed / not",
         f"{s['in_flight_committed']} / {s['in_flight_not_committed']}"),
        ("requests cut by the kill", cut),
        ("errors not caused by the kill (goal 0)", s["errors"]),
        ("sessions in use at the kill: a valid stored state / none (recompute)",
         f"{s['touched_restorable']} / {s['touched_recompute']}"),
        ("DRAM blobs lost with the process (recomputed)", s["dram_blobs_lost"]),
        ("restore source of acknowledged turns", sources),
        ("sessions created / offloads / reads", f"{s['sessions_created']} / {s['offloads']} / {s['reads']}"),
        ("blobs compressed before the kills / trials whose compression child had run jobs by the kill",
         f"{s['compressed']} / {s['trials_compressing']}"),
        ("restart s p50 / p95 / max", f"{cell(s['restart_p50_s'])} / {cell(s['restart_p95_s'])} / "
                                      f"{cell(s['restart_max_s'])}"),
        ("first start s (fresh data directory, restore profile measured)", cell(s["first_start_s"])),
        ("load before the kill s (mean)", cell(s["load_mean_s"], 1)),
        ("check s per trial: mean / max", f"{cell(s['check_mean_s'], 1)} / {cell(s['check_max_s'], 1)}"),
        ("after the last kill: turns served / sent", s["final_turns"]),
        ("service log warnings and errors (all trials)", s["service_log_warnings"]),
    ]
    return markdown_table(["measure", "value"], rows)


def has_converted_model(cache: Path) -> bool:
    return any((path / "config.json").exists() for path in cache.glob("*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-seconds", type=float, default=2.0, help="shortest load before a kill")
    # Up to 20 s: after a restart the compression child loads its own model copy before its first job
    # (10-30 s on the loaded 2-core machine), and kills during compressions are part of the point.
    parser.add_argument("--max-seconds", type=float, default=20.0, help="longest load before a kill")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-chars", type=int, default=600, help="user messages are cut to this many characters")
    parser.add_argument("--max-session-tokens", type=int, default=1500, help="a session ends before this size")
    parser.add_argument("--offload-probability", type=float, default=0.25, help="POST .../offload after a reply")
    parser.add_argument("--read-probability", type=float, default=0.15, help="GET .../messages before a turn")
    parser.add_argument("--idle-offload", type=float, default=0.5, help="the service's idle offload (s)")
    parser.add_argument("--compress-after", type=float, default=1.0, help="the service's compress-after (s)")
    parser.add_argument("--active-kv-budget-mb", type=int, default=48)
    parser.add_argument("--dram-budget-mb", type=int, default=16)
    parser.add_argument("--lmdb-budget-mb", type=int, default=64)
    parser.add_argument("--ssd-budget-mb", type=int, default=1024)
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE,
                        help="a converted model cache (this benchmark never converts one)")
    parser.add_argument("--data-dir", type=Path,
                        help="keep the data directory and the service logs here (default: a temporary directory)")
    parser.add_argument("--pause-while", help="before each trial, wait while this file exists (a quiet-machine flag)")
    parser.add_argument("--json", help="write the summary, every trial and every finding here")
    parser.set_defaults(time_scale=1.0)  # multiround.service_env scales simulated seconds; here they are real
    args = parser.parse_args()
    if not has_converted_model(args.model_cache):
        parser.error(f"no converted model in {args.model_cache}: pass --model-cache")
    if not 0 < args.min_seconds <= args.max_seconds:
        parser.error("need 0 < --min-seconds <= --max-seconds")

    root = args.data_dir or Path(tempfile.mkdtemp(prefix="statekeeper-crash-"))
    paths = {"data": root / "data", "logs": root / "logs"}
    paths["logs"].mkdir(parents=True, exist_ok=True)
    admin_token = secrets.token_hex(16)
    env = crash_env(args, admin_token)
    checker = Checker(env, paths["data"])
    workload, rng, trials = new_workload(args), random.Random(args.seed), []
    started = time.perf_counter()
    try:
        for number in range(args.trials):
            wait_while(args.pause_while)
            trial_started = time.perf_counter()
            trial = run_trial(number, workload, checker, env, paths, args, rng, admin_token)
            trial["trial_s"] = time.perf_counter() - trial_started
            trials.append(trial)
            print(json.dumps({k: trial[k] for k in ("trial", "start_s", "load_s", "acked", "check_s", "trial_s")}
                             | {"counts": trial["counts"], "errors": len(trial["errors"])}), flush=True)
        wait_while(args.pause_while)
        final = final_round(workload, checker, env, paths, args)
    except RuntimeError as exc:  # the service did not come back (or did not die): a failure in itself
        print(f"FAILED after {len(trials)} trials: {exc}\ndata directory and service logs kept in {root}")
        sys.exit(1)
    summary = summarize(trials, final) | {"wall_s": time.perf_counter() - started}
    findings = [f for row in trials + [final] for f in row["findings"]]
    errors = [e | {"trial": row.get("trial", "final")} for row in trials + [final] for e in row["errors"]]

    print(f"\nmachine: {machine_line()}; {args.trials} trials, {args.users} users, "
          f"load {args.min_seconds:g}-{args.max_seconds:g} s before each kill, max_tokens {args.max_tokens}; "
          f"active KV {args.active_kv_budget_mb} MB, idle offload {args.idle_offload:g} s, compress after "
          f"{args.compress_after:g} s, DRAM {args.dram_budget_mb} MB, LMDB {args.lmdb_budget_mb} MB, "
          f"SSD {args.ssd_budget_mb} MB; wall {summary['wall_s']:.0f} s "
          f"({summary['wall_s'] / max(1, args.trials):.1f} s per trial)\n")
    print(summary_table(summary))
    for finding in findings:
        print("FINDING:", json.dumps(finding)[:2000])
    for error in errors[:10]:
        print("error:", json.dumps(error))
    if args.json:
        write_json(args.json, {"args": vars(args) | {"model_cache": str(args.model_cache), "data_dir": str(root)},
                               "summary": summary, "findings": findings, "errors": errors, "trials": trials,
                               "final": final})
    failed = summary["lost_turns"] or summary["corrupt_served"] or summary["unsent_turns"]
    if failed or args.data_dir:
        print(f"data directory and service logs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
