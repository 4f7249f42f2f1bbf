"""Fidelity harness (`statekeeper eval`): what a compressed state costs the next replies.

ShareGPT continuations: the real next user turn and assistant reply teacher-forced after the state
(statekeeper/evaluation/teacher_forcing.py): top-1 agreement with the full KV, KL(full || compressed)
per token, and the perplexity ratio on the assistant tokens. Needle conversations check recall of a
fact planted early: graded on the greedy answer, and by the teacher-forced log-probability of the
fact's tokens. Recall conversations (statekeeper/evaluation/recall.py): several facts planted early,
unrelated ShareGPT turns, then an assistant answer restating some of them, teacher-forced like a
continuation: top-1 agreement with the full KV on the answer tokens and the answer's log-probability."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from statekeeper.chat import ChatFormatter
from statekeeper.compression import KVCompressor
from statekeeper.compression.reconstruction import DEFAULT_SCORING, ReconstructionScoring
from statekeeper.evaluation.calibration import calibrate_damage
from statekeeper.evaluation.needles import Needle, make_needles
from statekeeper.evaluation.recall import HELDOUT_KINDS, RecallCase, make_recall_cases
from statekeeper.evaluation.teacher_forcing import (ContinuationCase, FidelityTotals, State, build_state,
                                                    compare_continuation, log_probs, restored, sharegpt_cases)
from statekeeper.kv_cache import KVCache
from statekeeper.worker import ModelWorker


# -- needles ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class NeedleResult:
    is_correct: bool
    fact_logprob: float
    answer: str
    stored_bytes: int
    history_tokens: int


def run_needle(worker: ModelWorker, formatter: ChatFormatter, needle: Needle, compressor: KVCompressor,
               state: State | None = None) -> NeedleResult:
    """The state after the filler turns is compressed (the conversation went idle), then the question
    arrives: greedy answer after the prefix, and the teacher-forced log-probability of the fact."""
    end_of_turn = worker.tokenizer.eos_token_id
    history, _ = formatter.append_turns([], [], needle.history, end_of_turn)
    prompt = formatter.extend(history, needle.history + [{"role": "user", "content": needle.question}]).tokens
    prompt += formatter.encode(needle.answer_prefix)
    fact_tokens = formatter.encode(" " + needle.fact)
    state = state or build_state(worker, history[:-1])
    compressed = compressor.compress(state.cache.export_layers(), state.stats)
    rest = prompt[len(history) - 1 :]
    answer_cache, keep = restored(worker, compressed)
    answer = formatter.decode(answer_needle(worker, answer_cache, rest, keep), skip_special_tokens=True)
    scoring_cache, keep = restored(worker, compressed)
    rows = log_probs(worker, scoring_cache, rest + fact_tokens, keep)
    fact_rows = rows[len(rest) - 1 : len(rest) - 1 + len(fact_tokens)]
    fact_logprob = float(fact_rows.gather(1, torch.tensor(fact_tokens)[:, None]).sum())
    return NeedleResult(needle.fact.lower() in answer.lower(), fact_logprob, answer, compressed.stored_bytes,
                        len(history) - 1)


@torch.inference_mode()
def answer_needle(worker: ModelWorker, state: KVCache, rest: list[int], keep: torch.Tensor | None = None,
                  max_tokens: int = 12) -> list[int]:
    generated = []
    rows = log_probs(worker, state, rest, keep)
    for _ in range(max_tokens):
        token = int(rows[-1].argmax())
        if token in worker.stop_token_ids:
            break
        generated.append(token)
        rows = log_probs(worker, state, [token], keep)
    return generated


# -- recall of early facts ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RecallWorkload:
    """A set of recall conversations: its rows' field prefix, its table's title, where its fillers start in
    the ShareGPT stream, its seed, the facts it plants, and whether a case chains filler conversations."""

    prefix: str
    title: str
    skip: int
    seed_offset: int = 0
    kinds: list | None = None  # recall.py's recall kinds
    chain_fillers: bool = False


# The recall cases the defaults were chosen on; fillers from beyond the conversations the needles read.
RECALL = RecallWorkload("recall", "Recall of early facts (teacher-forced answers restating them)", skip=1000)
# Held out: other facts (recall.HELDOUT_KINDS), other fillers (from conversation 3,000 of the same stream; the
# recall cases start at 1,000 and take a few dozen conversations per length, so the two do not meet unless many
# long cases are asked for: not checked), another seed, and fillers chained to reach long histories (~4k tokens).
HELDOUT = RecallWorkload("heldout", "Held-out recall (other facts, other fillers, chained to the length: nothing "
                         "was tuned on these)", skip=3000, seed_offset=7919, kinds=HELDOUT_KINDS, chain_fillers=True)


def recall_continuation(formatter: ChatFormatter, case: RecallCase, end_of_turn: int) -> ContinuationCase:
    """The recall conversation as a teacher-forced continuation: the history is the planting exchange
    and the filler; the question and the restating answer follow; the answer's tokens are scored."""
    history, _ = formatter.append_turns([], [], case.history, end_of_turn)
    turn = [{"role": "user", "content": case.question}, {"role": "assistant", "content": case.answer}]
    full, ((begin, end),) = formatter.append_turns(history, case.history, turn, end_of_turn)
    return ContinuationCase(history, full[len(history) :], [(begin - len(history), end - len(history))])


# -- the evaluation run ----------------------------------------------------------------------------

def recall_cases(workload: RecallWorkload, count: int, formatter: ChatFormatter, length: int,
                 end_of_turn: int) -> list[ContinuationCase]:
    from statekeeper.evaluation import datasets

    if not count:
        return []
    fillers = (c for c in datasets.sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
    cases = make_recall_cases(count, itertools.islice(fillers, workload.skip, None), formatter, length,
                              seed=workload.seed_offset + length, kinds=workload.kinds,
                              chain_fillers=workload.chain_fillers)
    return [recall_continuation(formatter, case, end_of_turn) for case in cases]


def _recall_fields(workload: RecallWorkload, totals: FidelityTotals, conversations: int) -> dict:
    prefix, num_answers = workload.prefix, max(1, conversations)
    return {
        f"{prefix}_conversations": conversations, f"{prefix}_history_tokens_mean": totals.history_tokens / num_answers,
        f"{prefix}_bytes_per_token": totals.bytes_per_token,
        f"{prefix}_full_bytes_per_token": totals.full_bytes / max(1, totals.history_tokens),
        f"{prefix}_tokens": totals.tokens, f"{prefix}_top1_agreement": totals.top1_agreement,
        f"{prefix}_mean_kl": totals.mean_kl,
        f"{prefix}_answer_logprob_mean": totals.logprob_compressed / num_answers,
        f"{prefix}_answer_logprob_full_mean": totals.logprob_full / num_answers,
        f"{prefix}_answer_hits": totals.compressed_hits, f"{prefix}_answer_hits_full": totals.full_hits,
        f"{prefix}_live_fraction": totals.live_fraction, f"{prefix}_drift_events": totals.drift_events,
        f"{prefix}_retrieved_rows": totals.retrieved_rows,
        f"{prefix}_flipped_margins": sorted(totals.flipped_margins),
    }


def evaluate(worker: ModelWorker, methods: list[KVCompressor], lengths: list[int], num_conversations: int,
             num_needles: int, num_recall: int = 0, log=print,
             scorings: list[list[ReconstructionScoring]] | None = None, num_heldout: int = 0) -> list[dict]:
    """`scorings[i]`: how KVzip scores are made for methods[i] (the worker's default if None); a method
    that reads them is evaluated once per scoring, on the same states, as `method [scoring]` where the
    scoring is not the default or the method runs with several."""
    import time
    from collections import defaultdict

    from statekeeper.evaluation import datasets

    scorings = scorings or [[DEFAULT_SCORING]] * len(methods)
    formatter = ChatFormatter(worker.tokenizer)
    end_of_turn = worker.tokenizer.eos_token_id
    rows = []
    names = [name for method, own in zip(methods, scorings) for name in _row_names(method, own)]
    for length in lengths:
        cases = sharegpt_cases(formatter, datasets.sharegpt_conversations(min_turns=4), length, num_conversations,
                               end_of_turn)
        fillers = (c for c in datasets.sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
        needles = make_needles(num_needles, fillers, formatter, length, seed=length)
        workloads = [(workload, recall_cases(workload, count, formatter, length, end_of_turn))
                     for workload, count in ((RECALL, num_recall), (HELDOUT, num_heldout))]
        recall_totals = {workload.prefix: defaultdict(FidelityTotals) for workload, _ in workloads}
        totals = defaultdict(FidelityTotals)
        needle_results = defaultdict(list)
        compress_seconds, compress_cpu_seconds, restore_seconds = defaultdict(float), defaultdict(float), defaultdict(float)
        for index, case in enumerate(cases):
            state = build_state(worker, case.history[:-1])
            for name, method, scoring_seconds, scoring_cpu in _runs(worker, methods, scorings, state, case.history[:-1]):
                started, started_cpu = time.perf_counter(), time.process_time()
                compressed = method.compress(state.cache.export_layers(), state.stats)
                compressed_at = time.perf_counter()
                compress_cpu_seconds[name] += scoring_cpu + time.process_time() - started_cpu
                KVCache.from_layers(compressed.restore(), worker.device)
                compress_seconds[name] += scoring_seconds + compressed_at - started
                restore_seconds[name] += time.perf_counter() - compressed_at
                totals[name].add(compare_continuation(worker, case.history, case.continuation, case.spans,
                                                      method, state))
            log(f"length {length}: conversation {index + 1}/{len(cases)}")
        for index, needle in enumerate(needles):
            history, _ = formatter.append_turns([], [], needle.history, end_of_turn)
            state = build_state(worker, history[:-1])
            for name, method, _, _ in _runs(worker, methods, scorings, state, history[:-1]):
                needle_results[name].append(run_needle(worker, formatter, needle, method, state))
            log(f"length {length}: needle {index + 1}/{len(needles)} "
                + " ".join(f"{name}={'ok' if needle_results[name][-1].is_correct else 'miss'}" for name in names))
        for workload, cases_of_workload in workloads:
            for index, case in enumerate(cases_of_workload):
                state = build_state(worker, case.history[:-1])
                for name, method, _, _ in _runs(worker, methods, scorings, state, case.history[:-1]):
                    recall_totals[workload.prefix][name].add(compare_continuation(
                        worker, case.history, case.continuation, case.spans, method, state))
                log(f"length {length}: {workload.prefix} {index + 1}/{len(cases_of_workload)}")
        for name in names:
            t, results = totals[name], needle_results[name]
            recall_fields = {key: value for workload, cases_of_workload in workloads for key, value in
                             _recall_fields(workload, recall_totals[workload.prefix][name], len(cases_of_workload)).items()}
            rows.append({
                "length": length, "method": name, "conversations": len(cases),
                "history_tokens_mean": t.history_tokens / max(1, len(cases)),
                "bytes_per_token": t.bytes_per_token, "full_bytes_per_token": t.full_bytes / max(1, t.history_tokens),
                "top1_agreement": t.top1_agreement, "mean_kl": t.mean_kl, "perplexity_ratio": t.perplexity_ratio,
                "scored_tokens": t.tokens, "needles_correct": sum(r.is_correct for r in results),
                "needles": len(results),
                "fact_logprob_mean": sum(r.fact_logprob for r in results) / max(1, len(results)),
                "compress_ms_mean": 1000 * compress_seconds[name] / max(1, len(cases)),
                "compress_cpu_s_per_1k_tokens": 1000 * compress_cpu_seconds[name] / max(1, t.history_tokens),
                "restore_ms_mean": 1000 * restore_seconds[name] / max(1, len(cases)),
                **recall_fields,
            })
    return rows


def _needs_reconstruction(method: KVCompressor) -> bool:
    inner = getattr(method, "inner", method)
    return getattr(inner, "scorer", None) == "kvzip"


def _row_names(method: KVCompressor, scorings: list[ReconstructionScoring]) -> list[str]:
    if not _needs_reconstruction(method) or scorings == [DEFAULT_SCORING]:
        return [method.name]
    return [f"{method.name} [{scoring.name}]" for scoring in scorings]


def _runs(worker: ModelWorker, methods: list[KVCompressor], scorings: list[list[ReconstructionScoring]],
          state: State, history: list[int]):
    """(row name, method, scoring wall seconds, scoring CPU seconds) for every evaluation of a method on
    `state`; KVzip scores are made once per scoring, into `state.stats`, before the methods that read them."""
    import time

    matched = _matched(methods, state)
    yield from ((m.name, m, 0.0, 0.0) for m in matched if not _needs_reconstruction(m))
    readers = [(m, own) for m, own in zip(matched, scorings) if _needs_reconstruction(m)]
    for scoring in dict.fromkeys(s for _, own in readers for s in own):  # each once, in order
        started, started_cpu = time.perf_counter(), time.process_time()
        state.stats.reconstruction = worker.reconstruction_scores(state.cache, history, scoring)
        seconds, cpu = time.perf_counter() - started, time.process_time() - started_cpu
        for method, own in readers:
            if scoring in own:
                yield _row_names(method, own)[own.index(scoring)], method, seconds, cpu


def _matched(methods: list[KVCompressor], state: State) -> list[KVCompressor]:
    """Eviction baselines keep as many bytes as the first sharing method stores for this state."""
    from statekeeper.compression import CrossLayerSharing, H2OEviction

    reference = next((m for m in methods if isinstance(m, CrossLayerSharing)), None)
    if reference is not None and any(isinstance(m, H2OEviction) for m in methods):
        layers = state.cache.export_layers()
        fraction = reference.compress(layers, state.stats).stored_bytes / sum(k.nbytes + v.nbytes for k, v in layers)
        for method in methods:
            if isinstance(method, H2OEviction):
                method.keep_fraction = fraction
    return methods


def format_table(rows: list[dict]) -> str:
    """The ShareGPT and needle table, then the recall and held-out recall tables (each only when its workload
    ran)."""
    tables = []
    if any(r["conversations"] or r["needles"] for r in rows):
        lines = ["| history | method | stored bytes/token (×full) | top-1 agreement | mean KL | PPL ratio | needles | "
                 "fact log-prob | compress ms | compress CPU s / 1k tokens | restore ms |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| ~{r['length']:,} ({r['history_tokens_mean']:.0f}) | {r['method']} | {r['bytes_per_token']:.0f} "
                f"({r['bytes_per_token'] / max(1, r['full_bytes_per_token']):.3f}) | {r['top1_agreement']:.4f} | "
                f"{r['mean_kl']:.5f} | {r['perplexity_ratio']:.4f} | {r['needles_correct']}/{r['needles']} | "
                f"{r['fact_logprob_mean']:.3f} | {r['compress_ms_mean']:.1f} | "
                f"{r.get('compress_cpu_s_per_1k_tokens', 0.0):.2f} | {r['restore_ms_mean']:.1f} |"
            )
        tables.append("\n".join(lines))
    for workload in (RECALL, HELDOUT):
        p = workload.prefix
        if not any(r.get(f"{p}_conversations") for r in rows):
            continue
        lines = [f"{workload.title}:", "",
                 "| history | method | stored bytes/token (×full) | live entries | answers (tokens) | top-1 agreement | "
                 "mean KL | answer log-prob (full KV) | answer tokens = top-1 (full KV) | drifts / rows retrieved |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| ~{r['length']:,} ({r[f'{p}_history_tokens_mean']:.0f}) | {r['method']} | "
                f"{r[f'{p}_bytes_per_token']:.0f} "
                f"({r[f'{p}_bytes_per_token'] / max(1, r[f'{p}_full_bytes_per_token']):.3f}) | "
                f"{r[f'{p}_live_fraction']:.3f} | "
                f"{r[f'{p}_conversations']} ({r[f'{p}_tokens']}) | {r[f'{p}_top1_agreement']:.4f} | "
                f"{r[f'{p}_mean_kl']:.5f} | {r[f'{p}_answer_logprob_mean']:.2f} "
                f"({r[f'{p}_answer_logprob_full_mean']:.2f}) | {r[f'{p}_answer_hits']}/{r[f'{p}_tokens']} "
                f"({r[f'{p}_answer_hits_full']}/{r[f'{p}_tokens']}) | "
                f"{r[f'{p}_drift_events']} / {r[f'{p}_retrieved_rows']} |"
            )
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    from kernels.weight_linear import GEMMS, use_gemm
    from statekeeper.compression import by_name
    from statekeeper.config import KV_DTYPES, WorkerConfig
    from statekeeper.model_loader import load_model

    parser = argparse.ArgumentParser(prog="statekeeper eval", description="fidelity of compressed states")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--model-cache", default=str(Path.cwd() / ".cache" / "models"))
    parser.add_argument("--methods", default="none,minicache,krul_fixed,krul,h2o,int8,int4",
                        help="comma-separated; sharing methods take -v (default), -k or -kv suffixes")
    parser.add_argument("--ratio", type=float, default=0.2, help="r_l: fraction of layers that share")
    parser.add_argument("--gamma", type=float, default=0.6, help="I-R threshold")
    parser.add_argument("--lengths", default="1000,2000")
    parser.add_argument("--conversations", type=int, default=50)
    parser.add_argument("--needles", type=int, default=20)
    parser.add_argument("--recall", type=int, default=20,
                        help="recall conversations per length (facts planted early, asked at the end); "
                             "--conversations 0 --needles 0 runs only these")
    parser.add_argument("--heldout", type=int, default=0,
                        help="held-out recall conversations per length (other facts and fillers, chained to the "
                             "length: e.g. --lengths 1000,2000,4000 --heldout 12)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                        help="the KV cache's dtype, full KV's and the compressed states' alike (auto: the rule "
                             "model_loader.resolve_kv_dtype applies, not the service's timing at start)")
    parser.add_argument("--gemm", choices=("default", *sorted(GEMMS)), default="default",
                        help="the GEMM the quantized layers' many-row products run in (default: bfloat16 where "
                             "oneDNN has native bfloat16 kernels, else float32: kernels/weight_linear.default_gemm)")
    parser.add_argument("--calibration", type=int, default=8,
                        help="conversations that rank layer pairs for the damage methods (not evaluated)")
    parser.add_argument("--profile", help="a HeadProfile (statekeeper calibrate) for the -calibrated methods")
    parser.add_argument("--scorings", help="how KVzip scores are made, comma-separated (ReconstructionScoring.by_name: "
                        "reference, fused-c<N>[-int8]); several: each kvzip method once per scoring (default: the "
                        "worker's); a method written `name[scoring]` in --methods runs with that scoring only")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), num_threads=args.threads,
                          kv_dtype=args.kv_dtype)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    if args.gemm != "default":
        use_gemm(worker.model.modules(), args.gemm)
    print(f"KV cache in {worker.kv_dtype}, GEMM {args.gemm}", file=sys.stderr, flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    names, own_scorings = [], []  # `method[scoring]`: that method with that scoring only
    for entry in args.methods.split(","):
        name, _, own = entry.partition("[")
        names.append(name)
        own_scorings.append(own.rstrip("]"))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    damage = calibrate_damage(worker, names, args.calibration, lengths[0], log)
    rankings = {part: [pair for pair, _ in ranked] for part, ranked in damage.items()}
    profile = None
    if args.profile:
        from statekeeper.compression.head_profile import HeadProfile

        profile = HeadProfile.from_json(Path(args.profile).read_text())
        try:
            profile.check(worker.num_layers, worker.num_kv_heads)
        except ValueError as exc:
            raise SystemExit(f"{args.profile}: {exc}") from None
    methods = [by_name(name, args.ratio, args.gamma, rankings, profile) for name in names]
    if len({(m.name, tuple(o)) for m, o in zip(methods, own_scorings)}) < len(methods):
        raise SystemExit("a method appears twice with the same scoring")
    default = [ReconstructionScoring.by_name(n) for n in args.scorings.split(",")] if args.scorings else [DEFAULT_SCORING]
    scorings = [[ReconstructionScoring.by_name(own)] if own else default for own in own_scorings]
    rows = evaluate(worker, methods, lengths, args.conversations, args.needles, args.recall, log=log, scorings=scorings,
                    num_heldout=args.heldout)
    print(format_table(rows))
    if damage:
        print("\nDamage ranking (mean KL when the pair shares alone), least damaging first:")
        for part, ranked in damage.items():
            print(f"- {part}: " + ", ".join(f"{i}+{j} {kl:.4f}" for (i, j), kl in ranked))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "damage": damage}, indent=1))
