"""Chat templates that rewrite an earlier turn, with several users at once (issue 30): how much of each
resumed turn's prompt the service spares, and what the returning user waits, against the service before.

    python -m benchmarks.chat_shapes --baseline-repo <worktree of the commit before> --json chat_shapes.json

Concurrent users replay real ShareGPT conversations (benchmarks/multiround.py's schedule: think time, idle gaps
scaled by --time-scale, the idle offload scaled alike, so some turns restore from storage) through
POST /v1/chat/completions, resending the whole conversation each turn, streamed, greedy. The model is SmolLM2
as a local model directory whose chat template is one of benchmarks/harness/templates/ (or the bundled one,
the control), with the bundled model's weight precision and KV dtype set explicitly, so that the service
before CHAT_TEMPLATE existed runs the same model and template. Each template runs on this checkout (`new`)
and on --baseline-repo (`baseline`), back to back. The templates: control (the bundled one), think-on (a
reasoning template whose generation prompt opens a think block and whose history drops it; SmolLM2 rarely
closes it, so the reply is mostly reasoning and the answer the client resends short), think-off (the same
with thinking disabled: an empty think block in the prompt only), system-last (the system prompt moved before
the last user message), dated (today's date in the system turn as Llama 3.x templates write it, strftime_now:
the service's local time; each service runs in a time zone (TZ, a POSIX offset to the second) whose midnight
falls --midnight-s into the replay, by default when the median user would send round MIDNIGHT_ROUND were turns
instant, so most users' conversations cross it in an idle gap; both codes see the same midnight).

Per resumed turn: cached_tokens (usage.prompt_tokens_details) as a share of the previous turn's prompt and
reply, which a service that kept the whole conversation would spare, the same less the reply's reasoning
tokens (usage.completion_tokens_details: the think block a think-dropping template leaves out of the next
prompt, so no state can spare them), and the client's TTFT (its first streamed
chunk, which the service sends once the first token is out, whatever that token is: answer or reasoning). Reported per template and code: the share's median and mean, TTFT p50/p95 and their ratio to the
control template's on the same code, and what preparing next turns in background time cost the model thread
(GET /v1/admin/tiers `next_turn`: turns prepared, abandoned, tokens prefilled, CPU seconds).

A run's p95 of 30 resumed turns is its second-worst turn, and on a 2-core machine the same code gave 1.15x and
1.59x the control's p50 in two runs an hour apart (BENCHMARKS.md, issue 30): --repeats N runs the whole set N
times, one repeat after another (every other one in reverse order: ABBA), and reports each template and code
over all its repeats' turns together, with each repeat's ratios to the control beside them.

The start-up measurements (GEMM crossover, restore profile) are made once, by an untimed start before the runs,
and every run reads them; each run keeps the KV dtype and GEMM its service reported (GET /v1/admin/tiers), and
a ratio between runs whose choices differ (a baseline that rejects the shared measurements may choose its own)
is not computed: "not comparable: <why>"."""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, percentile, write_json
from benchmarks.harness.machine import REPO
from benchmarks.harness.service_choices import describe, reported_choices, why_not_comparable
from benchmarks.multiround import ServiceProcess, Turn, build_schedule, pick_users

TEMPLATES = REPO / "benchmarks" / "harness" / "templates"
TEMPLATE_FILES = {"think-on": "think"}  # the fixture a template name runs with, where they differ
# The bundled model's own weights, named, so a local copy of it runs the same way (README: WEIGHT_PRECISION); its
# KV dtype is --kv-dtype (KV_DTYPE=auto measures the bundled model's on each CPU: pass what it chose there).
MODEL_SETTINGS = {"STATEKEEPER_WEIGHT_PRECISION": "int4-g32-int8head"}


def model_dir(root: Path, model_cache: Path, template: str) -> Path:
    """SmolLM2 as a local model directory (links to the converted model) with `template`'s chat template."""
    source = next(model_cache.glob("SmolLM2-135M-Instruct*"))
    target = root / f"smollm2-{template}"
    target.mkdir()
    for path in source.iterdir():
        if path.name != "chat_template.jinja":
            (target / path.name).symlink_to(path)
    jinja = source / "chat_template.jinja" if template == "control" else TEMPLATES / f"{TEMPLATE_FILES.get(template, template)}.jinja"
    (target / "chat_template.jinja").write_text(jinja.read_text())
    return target


# The dated template's midnight, by default: when the median user would send this round were turns instant.
MIDNIGHT_ROUND = 2
STARTUP_ALLOWANCE_S = 90.0  # the service's start (model load, profile) must fit in this before the replay


def default_midnight_s(schedule: list[list[Turn]]) -> float:
    return statistics.median(sum(turn.wait_s for turn in turns[: MIDNIGHT_ROUND + 1]) for turns in schedule)


def zone_with_midnight_at(moment: float) -> str:
    """A POSIX TZ whose local midnight falls at the Unix time `moment` (to the second): an offset east of UTC
    up to 12 hours, or west (POSIX writes an offset east with a minus sign)."""
    offset = (86_400 - round(moment) % 86_400) % 86_400  # local = UTC + offset is 00:00:00 then
    if offset > 43_200:
        offset -= 86_400
    sign, offset = ("-" if offset >= 0 else "+"), abs(offset)
    return f"SKT{sign}{offset // 3600:02d}:{offset % 3600 // 60:02d}:{offset % 60:02d}"


async def send_turn(client: httpx.AsyncClient, model: str, messages: list[dict], turn: Turn, max_tokens: int
                    ) -> dict:
    """One streamed turn. A connection the server had already closed (its keep-alive ran out during the think
    time) is tried once more, as OpenAI's SDK retries; any other failure is the turn's error."""
    for attempt in (1, 2):
        try:
            return await _streamed_turn(client, model, messages, turn, max_tokens)
        except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
            if attempt == 2:
                return {"user": turn.user, "round": turn.round, "status": None, "error": repr(exc)}
        except httpx.HTTPError as exc:
            return {"user": turn.user, "round": turn.round, "status": None, "error": repr(exc)}


async def _streamed_turn(client: httpx.AsyncClient, model: str, messages: list[dict], turn: Turn,
                         max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    record = {"user": turn.user, "round": turn.round, "gap_s": turn.gap_s}
    started, ttft_ms, text, usage, restore = time.perf_counter(), None, [], None, {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return record | {"status": response.status_code, "error": (await response.aread()).decode()[:300]}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk.get("choices", []):
                # The first chunk comes once the first token is out (the service answers after it): the time to
                # first token whatever that token is (answer, reasoning, or a part held back from the stream).
                ttft_ms = ttft_ms or (time.perf_counter() - started) * 1000
                text.append(choice.get("delta", {}).get("content") or "")  # the answer, which the client resends
            usage = chunk.get("usage") or usage
            restore = (chunk.get("statekeeper") or {}).get("restore") or restore  # where the state came from
    return record | {"status": 200, "ttft_ms": ttft_ms, "reply": "".join(text), "restore": restore,
                     "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
                     "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                     # 0 from a service that does not report them (a baseline before issue 30)
                     "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)}


SKIPPED = "skipped"  # the status of a turn not sent: an earlier turn of its conversation failed


async def replay_user(client: httpx.AsyncClient, model: str, turns: list[Turn], max_tokens: int,
                      started: float) -> list[dict]:
    """The user's turns in order; after a failed turn the conversation cannot go on (the client has no reply
    to resend), so the turns left are recorded as skipped, not dropped: a run's count of turns stays whole."""
    messages, records = [], []
    for index, turn in enumerate(turns):
        await asyncio.sleep(turn.wait_s)
        messages.append({"role": "user", "content": turn.content})
        sent_s = time.time() - started
        record = await send_turn(client, model, messages, turn, max_tokens) | {"sent_s": sent_s}
        records.append(record)
        if record["status"] != 200:
            records += [{"user": left.user, "round": left.round, "gap_s": left.gap_s, "status": SKIPPED,
                         "error": f"not sent: round {turn.round} failed"} for left in turns[index + 1:]]
            break
        messages.append({"role": "assistant", "content": record["reply"]})
    return records


def service_env(model: Path, args, admin_token: str) -> dict[str, str]:
    return MODEL_SETTINGS | {"STATEKEEPER_KV_DTYPE": args.kv_dtype} | {
        "STATEKEEPER_MODEL": str(model),
        "STATEKEEPER_ADMIN_TOKEN": admin_token,
        "STATEKEEPER_IDLE_OFFLOAD_SECONDS": f"{args.idle_offload * args.time_scale:g}",
        "STATEKEEPER_COMPRESS_AFTER_SECONDS": f"{args.compress_after * args.time_scale:g}",
        "STATEKEEPER_PLACEMENT_POLICY": args.placement_policy}


def measure_profiles(args, root: Path) -> None:
    """One untimed start (the control template, this checkout) that only measures: the GEMM crossover and the
    restore profile land in root/profiles, which every run then reads (they are kept per model weights, the
    same for every template). Each run on a fresh data directory measured its own before, and two runs could
    take the GEMM from different row counts."""
    data_dir = Path(tempfile.mkdtemp(prefix="measure-", dir=root))
    service = ServiceProcess(data_dir, service_env(model_dir(data_dir, args.model_cache, "control"), args,
                                                   secrets.token_hex(16)))
    service.start()
    service.stop()
    if (data_dir / "profiles").exists():
        shutil.copytree(data_dir / "profiles", root / "profiles")


async def replay(url: str, model_name: str, schedule, args, admin_token: str) -> tuple[float, list, dict]:
    """Every user's turns against the service at `url`: the wall time, each user's records, and
    GET /v1/admin/tiers after ({} where it does not answer)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started, replay_started = time.perf_counter(), time.time()
        per_user = await asyncio.gather(*(replay_user(client, model_name, turns, args.max_tokens, replay_started)
                                          for turns in schedule))
        wall_s = time.perf_counter() - started
        await asyncio.sleep(1.0)  # the last turns' next-turn preparation, if any, ends
        stats = await client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {admin_token}"})
        return wall_s, per_user, stats.json() if stats.status_code == 200 else {}


def run(code: str, template: str, repo: Path, schedule, args, root: Path) -> dict:
    data_dir = Path(tempfile.mkdtemp(prefix=f"{code}-{template}-", dir=root))
    if (root / "profiles").exists():  # measure_profiles's
        shutil.copytree(root / "profiles", data_dir / "profiles")
    model = model_dir(data_dir, args.model_cache, template)
    admin_token = secrets.token_hex(16)
    env = service_env(model, args, admin_token)
    replay_at = None
    if template == "dated":  # the service's midnight falls --midnight-s into the replay
        replay_at = time.time() + STARTUP_ALLOWANCE_S
        env["TZ"] = zone_with_midnight_at(replay_at + args.midnight_s)
    service = ServiceProcess(data_dir, env, repo=repo)
    service.start()
    if replay_at is not None:
        if time.time() > replay_at:
            raise SystemExit(f"the service took over {STARTUP_ALLOWANCE_S:g} s to start: the midnight would move")
        time.sleep(replay_at - time.time())
    try:
        wall_s, per_user, stats = asyncio.run(replay(service.url, model.name, schedule, args, admin_token))
    finally:
        service.stop()
    return {"code": code, "template": template, "wall_s": wall_s, "users": per_user,
            "next_turn": stats.get("next_turn"), "choices": reported_choices(stats),
            # Where the two cores' time went: live and background seconds, and live work's waits, per lane.
            "lanes": {lane: stats.get(lane) for lane in ("model_thread", "long_prefill_lane")},
            "midnight_s": args.midnight_s if template == "dated" else None}


def pooled(results: list[dict]) -> dict:
    """Repeats of one template on one code as one result: their users' turns together (each user's turns stay
    one sequence), the next-turn counters summed."""
    counters = [result["next_turn"] for result in results]
    next_turn = None if None in counters else {name: sum(c[name] for c in counters) for name in counters[0]}
    varied = next(filter(None, (why_not_comparable(results[0].get("choices"), r.get("choices")) for r in results)),
                  None)
    return results[0] | {"wall_s": sum(result["wall_s"] for result in results), "next_turn": next_turn,
                         "users": [records for result in results for records in result["users"]],
                         "choices_varied": varied}


def why_not_comparable_summaries(mine: dict, theirs: dict) -> str | None:
    """Why two summaries' TTFTs cannot be divided (other kernels, or repeats that varied between them), or None."""
    for varied in (mine.get("choices_varied"), theirs.get("choices_varied")):
        if varied:
            return f"{varied} between repeats"
    return why_not_comparable(mine.get("choices"), theirs.get("choices"))


def control_ratios(summaries: list[dict]) -> dict[tuple[str, str], tuple[float, float]]:
    """(template, code) -> its TTFT p50 and p95 over the control template's on the same code, where both ran on
    the same kernels (why_not_comparable_summaries)."""
    control = {s["code"]: s for s in summaries if s["template"] == "control" and s["resumed_turns"]}
    return {(s["template"], s["code"]): (s["ttft_p50_ms"] / control[s["code"]]["ttft_p50_ms"],
                                         s["ttft_p95_ms"] / control[s["code"]]["ttft_p95_ms"])
            for s in summaries if s["code"] in control and s["resumed_turns"]
            and not why_not_comparable_summaries(s, control[s["code"]])}


def control_reasons(summaries: list[dict]) -> dict[tuple[str, str], str]:
    """(template, code) -> why its TTFTs are not comparable to the control's on the same code, where they are not."""
    control = {s["code"]: s for s in summaries if s["template"] == "control"}
    reasons = {(s["template"], s["code"]): why_not_comparable_summaries(s, control[s["code"]])
               for s in summaries if s["code"] in control}
    return {key: reason for key, reason in reasons.items() if reason}


def code_lines(summaries: list[dict]) -> list[str]:
    """A line for each template whose new and baseline runs ran other kernels: their rows are not comparable."""
    by_cell = {(s["template"], s["code"]): s for s in summaries}
    lines = []
    for (template, code), s in by_cell.items():
        baseline = by_cell.get((template, "baseline"))
        reason = why_not_comparable_summaries(s, baseline) if code == "new" and baseline else None
        if reason:
            lines.append(f"{template}: new/baseline not comparable: {reason}")
    return lines


def summarize(result: dict) -> dict:
    shares, kept_shares, ttfts, errors, skipped, first_error = [], [], [], 0, 0, None
    midnight = {"shares": [], "ttfts": [], "after_s": []}  # each user's first turn after the midnight
    for records in result["users"]:
        failed = [r for r in records if r["status"] not in (200, SKIPPED)]
        errors += len(failed)
        skipped += sum(r["status"] == SKIPPED for r in records)
        first_error = first_error or next((r["error"] for r in failed), None)
        for before, turn in zip(records, records[1:]):
            if turn["status"] == 200 and before["status"] == 200:
                shares.append(turn["cached_tokens"] / (before["prompt_tokens"] + before["completion_tokens"]))
                kept = before["prompt_tokens"] + before["completion_tokens"] - before.get("reasoning_tokens", 0)
                kept_shares.append(turn["cached_tokens"] / kept)
                ttfts.append(turn["ttft_ms"])
                if result.get("midnight_s") is not None and before["sent_s"] < result["midnight_s"] <= turn["sent_s"]:
                    midnight["shares"].append(shares[-1])
                    midnight["ttfts"].append(turn["ttft_ms"])
                    midnight["after_s"].append(round(turn["sent_s"] - result["midnight_s"], 2))
    return {"code": result["code"], "template": result["template"], "wall_s": result["wall_s"], "errors": errors,
            "skipped": skipped,
            "next_turn": result["next_turn"], "choices": result.get("choices"),
            "choices_varied": result.get("choices_varied"),
            "first_error": first_error, "resumed_turns": len(shares), "share_median": statistics.median(shares) if shares else None,
            "share_mean": statistics.fmean(shares) if shares else None,
            "kept_share_median": statistics.median(kept_shares) if kept_shares else None,
            "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p95_ms": percentile(ttfts, 0.95),
            "midnight_turns": None if result.get("midnight_s") is None else {
                "count": len(midnight["ttfts"]), "sent_after_midnight_s": midnight["after_s"],
                "cached_shares": [round(share, 3) for share in midnight["shares"]],
                "ttft_ms": [round(ttft) for ttft in midnight["ttfts"]]}}


def _next_turn_cell(counters: dict | None) -> str:
    if counters is None:  # a service before next-turn preparation
        return "—"
    return (f"{counters['prepared']} ({counters['abandoned']}): {counters['tokens']} tokens, "
            f"{counters['seconds']:.2f} s")


def _errors_cell(s: dict) -> str:
    return f"{s['errors']}" + (f" ({s['skipped']} skipped)" if s.get("skipped") else "")


def table(summaries: list[dict]) -> str:
    """One row per template and code (over all repeats); each repeat's ratios in the last column but one."""
    ratios, reasons = control_ratios(summaries), control_reasons(summaries)
    rows = []
    for s in summaries:
        if not s["resumed_turns"]:
            rows.append([s["template"], s["code"], 0, *["—"] * 6, f"{_errors_cell(s)}: {s['first_error']}",
                         describe(s.get("choices"))])
            continue
        ratio, reason = ratios.get((s["template"], s["code"])), reasons.get((s["template"], s["code"]))
        each = ", ".join(f"{p50:.2f}× / {p95:.2f}×" for p50, p95 in s.get("repeat_ratios", []))
        rows.append([s["template"], s["code"], s["resumed_turns"],
                     f"{s['share_median']:.3f} / {s['share_mean']:.3f}", f"{s['kept_share_median']:.3f}",
                     f"{s['ttft_p50_ms']:.0f} / {s['ttft_p95_ms']:.0f}",
                     f"not comparable: {reason}" if reason else "—" if ratio is None else
                     f"{ratio[0]:.2f}× / {ratio[1]:.2f}×", each or "—",
                     _next_turn_cell(s["next_turn"]), _errors_cell(s), describe(s.get("choices"))])
    return markdown_table(["template", "code", "resumed turns",
                           "cached share of the previous prompt + reply: median / mean",
                           "… of it less its reasoning tokens (what the next prompt keeps): median", "TTFT p50 / p95 ms",
                           "p50 / p95 ÷ control", "each repeat's p50 / p95 ÷ control",
                           "next turns prepared (abandoned): tokens, CPU s", "errors (turns skipped after)",
                           "KV dtype, GEMM"], rows)


def summaries_over_repeats(results: list[dict]) -> list[dict]:
    """Each template and code (in the order they first ran) over all its repeats (`pooled`), with each repeat's ratios
    to the control on its code (`repeat_ratios`, where the control ran)."""
    cells = list(dict.fromkeys((result["template"], result["code"]) for result in results))
    repeats = sorted({result.get("repeat", 0) for result in results})
    each = [control_ratios([summarize(r) for r in results if r.get("repeat", 0) == repeat]) for repeat in repeats]
    summaries = []
    for template, code in cells:
        mine = [r for r in results if (r["template"], r["code"]) == (template, code)]
        summary = summarize(pooled(mine)) | {"repeats": len(mine)}
        summary["repeat_ratios"] = [ratios[(template, code)] for ratios in each if (template, code) in ratios]
        summaries.append(summary)
    return summaries


def run_order(templates: list[str], codes: list[tuple[str, Path]], repeat: int) -> list[tuple[str, str, Path]]:
    """(template, code, repo) in the order repeat `repeat` runs them: each template on each code, the whole set
    reversed every other repeat (ABBA), so neither code nor any template always runs first, on a machine still
    warming up, or last, after the others' files and memory have built up."""
    order = [(template, code, repo) for template in templates for code, repo in codes]
    return order if repeat % 2 == 0 else order[::-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--templates", default="control,think-on,think-off,system-last,dated",
                        type=lambda v: v.split(","))
    parser.add_argument("--baseline-repo", type=Path, help="the checkout of the service before (omit: new only)")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-chars", type=int, default=1500)
    parser.add_argument("--min-user-chars", type=int, default=1500)
    parser.add_argument("--gaps", default="1,30,300", type=lambda v: [float(x) for x in v.split(",")])
    parser.add_argument("--time-scale", type=float, default=0.1)
    parser.add_argument("--idle-offload", type=float, default=60.0)
    parser.add_argument("--compress-after", type=float, default=120.0,
                        help="with --placement-policy lru: idle seconds before a stored blob is compressed")
    parser.add_argument("--placement-policy", default="value", choices=["value", "lru"],
                        help="the service's PLACEMENT_POLICY (value: the default; it decides compression itself)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the KV dtype KV_DTYPE=auto chooses for the bundled model on this CPU (GET /healthz "
                             "notes it; bfloat16: its rule without a measurement)")
    parser.add_argument("--midnight-s", type=float,
                        help="the dated template's midnight, seconds into the replay (default: see above)")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--repeats", type=int, default=1, help="runs of the whole set, one after another")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    schedule = build_schedule(pick_users(args.users, args.rounds, args.min_user_chars, args.max_chars),
                              args.gaps, args.time_scale, args.seed)
    if args.midnight_s is None:
        args.midnight_s = default_midnight_s(schedule)
    codes = [("new", REPO)] + ([("baseline", args.baseline_repo)] if args.baseline_repo else [])
    print(f"machine: {machine_line()}", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="statekeeper-chat-shapes-") as root:
        measure_profiles(args, Path(root))
        for repeat in range(args.repeats):
            for template, code, repo in run_order(args.templates, codes, repeat):
                results.append(run(code, template, repo, schedule, args, Path(root)) | {"repeat": repeat})
                print(json.dumps(summarize(results[-1]) | {"repeat": repeat}), flush=True)
    summaries = summaries_over_repeats(results)
    print(table(summaries))
    for line in code_lines(summaries):
        print(line)
    for s in summaries:
        if s["midnight_turns"] is not None:
            print(f"{s['code']}, dated: first turns after the midnight at {args.midnight_s:.1f} s: {s['midnight_turns']}")
    if args.json:
        write_json(args.json, {"args": {k: str(v) for k, v in vars(args).items()}, "summaries": summaries,
                               "runs": results})


if __name__ == "__main__":
    main()
