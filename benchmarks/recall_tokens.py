"""Which answer tokens of the recall workload a compressed state gets wrong, and by how much.

    python -m benchmarks.recall_tokens --lengths 2000 --recall 20 --methods none,kvzip@0.5,int4-rot-g32-s1 --json tokens.json

The recall cases of `statekeeper eval --recall` (statekeeper/evaluation/recall.py), every method on the
same state and KVzip scores; for each scored answer token: the full KV's top-1 and its margin over the
runner-up (nats), the compressed state's top-1, KL(full || compressed), and whether the token is part of
a restated fact's value. Prints, per method, the top-1 disagreements split by fact / other tokens, the
full-KV margins of the disagreeing tokens and how many of them the full KV predicted right."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from benchmarks.harness import markdown_table, write_json
from statekeeper.chat import ChatFormatter
from statekeeper.compression import by_name
from statekeeper.compression.reconstruction import DEFAULT_SCORING
from statekeeper.config import WorkerConfig
from statekeeper.evaluation import datasets
from statekeeper.evaluation.fidelity import RECALL, _needs_reconstruction, recall_continuation
from statekeeper.evaluation.recall import make_recall_cases
from statekeeper.evaluation.teacher_forcing import build_state, log_probs, restored
from statekeeper.kv_cache import KVCache
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker


def fact_token_flags(formatter: ChatFormatter, answer_tokens: list[int], case) -> list[bool]:
    """For each answer token: does its text overlap a restated fact's value?"""
    chars = set()
    for fact in case.asked:
        at = case.answer.find(fact.value)
        chars |= set(range(at, at + len(fact.value))) if at >= 0 else set()
    flags = []
    for i in range(len(answer_tokens)):
        begin, end = len(formatter.decode(answer_tokens[:i])), len(formatter.decode(answer_tokens[: i + 1]))
        flags.append(any(c in chars for c in range(begin, end)))
    return flags


def token_rows(worker, formatter, case, methods) -> list[dict]:
    continuation = recall_continuation(formatter, case, worker.tokenizer.eos_token_id)
    (begin, end), = continuation.spans
    history = continuation.history
    facts = fact_token_flags(formatter, continuation.continuation[begin:end], case)
    state = build_state(worker, history[:-1])
    full_layers = state.cache.export_layers()
    fed = history[-1:] + continuation.continuation
    full_rows = log_probs(worker, KVCache.from_layers(full_layers, worker.device), fed)
    if any(_needs_reconstruction(m) for m in methods):
        state.stats.reconstruction = worker.reconstruction_scores(state.cache, history[:-1], DEFAULT_SCORING)
    results = []
    for method in methods:
        compressed = method.compress(full_layers, state.stats)
        cache, keep = restored(worker, compressed)
        rows = log_probs(worker, cache, fed, keep)
        tokens = []
        for i in range(begin, end):
            full, comp, target = full_rows[i], rows[i], continuation.continuation[i]
            top2 = full.topk(2)
            tokens.append({"text": formatter.decode([target]), "fact": facts[i - begin],
                           "target_is_full_top1": target == int(top2.indices[0]),
                           "full_top1": int(top2.indices[0]), "compressed_top1": int(comp.argmax()),
                           "full_margin": float(top2.values[0] - top2.values[1]),
                           "kl": float((full.exp() * (full - comp)).sum())})
        results.append({"method": method.name, "stored_bytes": compressed.stored_bytes,
                        "history_tokens": len(history) - 1, "answer": case.answer, "tokens": tokens})
    return results


def saved_rows(path: Path) -> list[dict]:
    """The rows of a --json file: under "rows", or the file's whole list in those written before issue 29."""
    saved = json.loads(path.read_text())
    return saved["rows"] if isinstance(saved, dict) else saved


def summary(rows: list[dict]) -> str:
    table = []
    for (length, name) in dict.fromkeys((r["length"], r["method"]) for r in rows):
        mine = [r for r in rows if (r["length"], r["method"]) == (length, name)]
        tokens = [t for r in mine for t in r["tokens"]]
        flips = [t for t in tokens if t["full_top1"] != t["compressed_top1"]]
        fact, other = [t["kl"] for t in tokens if t["fact"]], [t["kl"] for t in tokens if not t["fact"]]
        table.append([
            f"~{length:,}", name,
            f"{sum(r['stored_bytes'] for r in mine) / sum(r['history_tokens'] for r in mine):,.0f}", len(tokens),
            f"{len(flips)} ({sum(t['fact'] for t in flips)} / {sum(not t['fact'] for t in flips)})",
            f"{1 - len(flips) / max(1, len(tokens)):.4f}", f"{sum(t['kl'] for t in tokens) / max(1, len(tokens)):.4f}",
            f"{sum(fact) / max(1, len(fact)):.4f} / {sum(other) / max(1, len(other)):.4f}",
            ", ".join(f"{m:.2f}" for m in sorted(t["full_margin"] for t in flips)),
            sum(t["target_is_full_top1"] for t in flips)])
    return markdown_table(["history", "method", "bytes/token", "answer tokens", "disagree (fact / other)", "top-1",
                           "mean KL", "KL fact / other", "full-KV margins of the disagreements (nats)",
                           "full KV right there"], table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-cache", default=str(Path.cwd() / ".cache" / "models"))
    parser.add_argument("--methods", help="comma-separated method names (required unless --summarize)")
    parser.add_argument("--lengths", default="2000")
    parser.add_argument("--recall", type=int, default=20)
    parser.add_argument("--cases", help="only these case numbers (comma-separated), e.g. to split a run")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the per-token rows here")
    parser.add_argument("--summarize", nargs="*", help="only print the summary of these --json files")
    args = parser.parse_args()
    if args.summarize:
        print(summary([row for path in args.summarize for row in saved_rows(Path(path))]))
        return
    config = WorkerConfig(model="smollm2", model_cache_dir=Path(args.model_cache), num_threads=args.threads)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    formatter = ChatFormatter(worker.tokenizer)
    methods = [by_name(name) for name in args.methods.split(",")]
    only = None if args.cases is None else {int(x) for x in args.cases.split(",")}
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        fillers = (c for c in datasets.sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
        cases = make_recall_cases(args.recall, itertools.islice(fillers, RECALL.skip, None), formatter, length,
                                  seed=length)
        for index, case in enumerate(cases):
            if only is None or index in only:
                rows += [{"length": length, "case": index} | row for row in token_rows(worker, formatter, case, methods)]
                print(f"length {length}: recall {index + 1}/{len(cases)}", file=sys.stderr, flush=True)
    if args.json:
        write_json(args.json, {"rows": rows})
    print(summary(rows))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
