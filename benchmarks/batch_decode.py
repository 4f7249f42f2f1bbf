"""What one batched forward buys (issue 17): N conversations decoding at once, each over its own KV cache
(statekeeper/batch_forward.py), against the same N stepping one after another, on the model the service
loads, side by side in one run. Contexts are real ShareGPT conversations rendered with the chat template
and cut to --context tokens.

    python -m benchmarks.batch_decode --sessions 1,4,8,16 --context 1000 --steps 16 --threads 1
    python -m benchmarks.batch_decode --sessions 1,8,16 --kv-dtypes float32,bfloat16

--kv-dtypes measures each KV cache dtype (WorkerConfig.kv_dtype) in turn, and --gemm-rows each threshold of the
weight-only layers' GEMM (measured, as the service at start, or a number), one worker each, in one run.

Per N: ms per step of the N sessions batched and one after another, the aggregate decode tokens/s of
both, and the batched rate over the single-stream rate (issue 17's target at 8: >= 2.5x). Medians over
--repeats rounds, the two ways interleaved within each round.

Batch invariance: every session first decodes --steps greedy tokens alone; the batched run is then fed
those same tokens (teacher forcing), so each of its positions is compared with the one alone: the share
of positions whose greedy token agrees, and the largest logit difference."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness import MODEL_CACHE, machine_line, markdown_table, write_json
from benchmarks.harness.model import use_gemm_rows

from statekeeper.batch_forward import Segment
from statekeeper.chat import ChatFormatter
from statekeeper.config import WorkerConfig
from statekeeper.evaluation.datasets import sharegpt_conversations
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker


def contexts(worker: ModelWorker, count: int, length: int) -> list[list[int]]:
    formatter = ChatFormatter(worker.tokenizer)
    found = []
    for conversation in sharegpt_conversations(min_turns=2):
        messages = [{"role": role, "content": content} for role, content in conversation]
        tokens = formatter.encode(formatter.render(messages, add_generation_prompt=False))
        if len(tokens) >= length:
            found.append(tokens[:length])
        if len(found) == count:
            return found
    raise SystemExit(f"only {len(found)} ShareGPT conversations reach {length} tokens")


def prefilled(worker: ModelWorker, stories: list[list[int]]):
    caches = []
    for tokens in stories:
        cache = worker.new_cache()
        worker.prefill(cache, tokens)
        caches.append(cache)
    return caches


def measure(worker: ModelWorker, stories: list[list[int]], steps: int, repeats: int) -> dict:
    n = len(stories)
    caches = prefilled(worker, stories)
    alone_tokens, alone_logits = [], []
    for cache in caches:  # the reference: each session alone, greedy
        token, out, logits = 2, [], []
        for _ in range(steps):
            row = worker.step([Segment(cache, [token])])[0]
            token = int(row.argmax())
            out.append(token)
            logits.append(row)
        alone_tokens.append(out)
        alone_logits.append(logits)
        cache.truncate(len(stories[0]))
    batched_ms, alone_ms = [], []
    agree, positions, worst = 0, 0, 0.0
    for repeat in range(repeats):
        fed = [2] * n
        for index in range(steps):  # batched, teacher-forced with the tokens each chose alone
            started = time.perf_counter()
            rows = worker.step([Segment(cache, [token]) for cache, token in zip(caches, fed)])
            batched_ms.append((time.perf_counter() - started) * 1000)
            if repeat == 0:
                for session, row in enumerate(rows):
                    agree += int(row.argmax()) == alone_tokens[session][index]
                    worst = max(worst, float((row - alone_logits[session][index]).abs().max()))
                    positions += 1
            fed = [alone_tokens[session][index] for session in range(n)]
        for cache in caches:
            cache.truncate(len(stories[0]))
        fed = [2] * n
        for index in range(steps):  # the same steps, one session after another
            started = time.perf_counter()
            for cache, token in zip(caches, fed):
                worker.step([Segment(cache, [token])])
            alone_ms.append((time.perf_counter() - started) * 1000)
            fed = [alone_tokens[session][index] for session in range(n)]
        for cache in caches:
            cache.truncate(len(stories[0]))
    batched, alone = statistics.median(batched_ms), statistics.median(alone_ms)
    return {"sessions": n, "batched_step_ms": batched, "one_by_one_step_ms": alone,
            "batched_tokens_per_s": n * 1000 / batched, "one_by_one_tokens_per_s": n * 1000 / alone,
            "top1_agreement": agree / positions, "max_logit_diff": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,4,8,16")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-dtypes", default="auto", help="comma-separated: auto,float32,bfloat16,float16")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-cache", type=Path, default=MODEL_CACHE)
    parser.add_argument("--gemm-rows", default="measured",
                        help="comma-separated: from how many rows the weight-only layers use the GEMM (measured: "
                             "as the service chooses at start), one worker each")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    results = {}
    for kv_dtype in args.kv_dtypes.split(","):
        for gemm_rows in args.gemm_rows.split(","):
            config = WorkerConfig(model=args.model, model_cache_dir=args.model_cache, num_threads=args.threads,
                                  kv_dtype=kv_dtype)
            worker = use_gemm_rows(ModelWorker(load_model(config.model, config.model_cache_dir), config), gemm_rows)
            stories = contexts(worker, max(counts), args.context)
            rows = {m.dense_from_rows for m in worker.model.modules() if hasattr(m, "dense_from_rows")}
            name = kv_dtype if args.gemm_rows == "measured" else f"{kv_dtype}, GEMM rows {gemm_rows} {sorted(rows)}"
            results[name] = [measure(worker, stories[:n], args.steps, args.repeats) for n in counts]
            del worker
    print(f"# {machine_line()}, torch threads {args.threads}, context {args.context}, "
          f"{args.steps} steps x {args.repeats} repeats")
    table = []
    for kv_dtype, rows in results.items():
        single = next((r["batched_tokens_per_s"] for r in rows if r["sessions"] == 1), None)
        for r in rows:
            gain = r["batched_tokens_per_s"] / single if single else float("nan")
            table.append([kv_dtype, r["sessions"], f"{r['batched_step_ms']:.1f}", f"{r['one_by_one_step_ms']:.1f}",
                          f"{r['batched_tokens_per_s']:.1f}", f"{r['one_by_one_tokens_per_s']:.1f}", f"{gain:.2f}×",
                          f"{r['top1_agreement']:.4f}", f"{r['max_logit_diff']:.2e}"])
    print(markdown_table(["KV dtype", "sessions", "batched ms/step", "one by one ms/step", "batched tokens/s",
                          "one by one tokens/s", "batched ÷ single stream", "greedy agreement with alone",
                          "max logit diff"], table))
    if args.json:
        write_json(args.json, {"args": vars(args) | {"model_cache": str(args.model_cache)}, "rows": results})


if __name__ == "__main__":
    main()
