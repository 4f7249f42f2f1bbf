"""Fidelity harness: what a compressed state costs the next replies.

For a conversation state (history tokens) and a continuation (the next user turn and assistant reply,
teacher-forced), compares the model's next-token distributions with the full KV and with a compressed
KV: top-1 agreement, KL(full || compressed) per token, and perplexity on the assistant tokens. Needle
conversations check recall of a fact planted early: graded on the greedy answer, and by the
teacher-forced log-probability of the fact's tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from statekeeper.chat import ChatFormatter
from statekeeper.needles import Needle, make_needles  # noqa: F401  (re-exported for callers)
from statekeeper.compression import Compressed, KVCompressor
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.kv_cache import KVCache
from statekeeper.worker import ModelWorker


@dataclass(slots=True)
class FidelityTotals:
    tokens: int = 0
    agreements: int = 0
    kl_sum: float = 0.0
    logprob_full: float = 0.0
    logprob_compressed: float = 0.0
    stored_bytes: int = 0
    full_bytes: int = 0
    history_tokens: int = 0

    def add(self, other: "FidelityTotals") -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def top1_agreement(self) -> float:
        return self.agreements / max(1, self.tokens)

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(1, self.tokens)

    @property
    def perplexity_ratio(self) -> float:
        """PPL(compressed) / PPL(full) on the scored tokens."""
        return math.exp((self.logprob_full - self.logprob_compressed) / max(1, self.tokens))

    @property
    def bytes_per_token(self) -> float:
        return self.stored_bytes / max(1, self.history_tokens)


@dataclass(slots=True)
class State:
    cache: KVCache
    stats: AttentionStats
    reference_rows: dict = field(default_factory=dict)  # continuation -> full-KV log-probs, computed once


def build_state(worker: ModelWorker, tokens: list[int]) -> State:
    """The conversation's KV and the attention statistics gathered while computing it."""
    cache, stats = worker.new_cache(), worker.new_stats()
    worker.prefill(cache, tokens, stats)
    return State(cache, stats)


def restored(worker: ModelWorker, compressed: Compressed) -> tuple[KVCache, torch.Tensor | None]:
    """What a restore would attend to: rebuilt from the stored form (not the compressor's own copy)."""
    return KVCache.from_layers(compressed.restore(), worker.device, compressed.head_bias), compressed.keep


@torch.inference_mode()
def _log_probs(worker: ModelWorker, cache: KVCache, tokens: list[int], keep: torch.Tensor | None = None):
    """Log-softmax at every position of `tokens` appended to `cache` (the cache is left extended).
    `keep` masks evicted history positions out of attention."""
    rows = []
    chunk = worker.config.prefill_chunk_tokens
    for start in range(0, len(tokens), chunk):
        piece = tokens[start : start + chunk]
        input_ids = torch.tensor([piece], device=worker.device)
        mask = None
        if keep is not None:
            mask = torch.ones(1, cache.num_tokens + len(piece), dtype=torch.long, device=worker.device)
            mask[0, : len(keep)] = keep.long()
        logits = worker.run_model(cache, input_ids, attention_mask=mask).logits[0]
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    return torch.cat(rows)


def compare_continuation(worker: ModelWorker, history: list[int], continuation: list[int],
                         scored: list[tuple[int, int]], compressor: KVCompressor,
                         state: State | None = None) -> FidelityTotals:
    """`continuation` follows `history`; `scored` are [start, end) spans within it (assistant tokens).
    The last history token is fed with the continuation, so its prediction covers the first token."""
    state = state or build_state(worker, history[:-1])
    full_layers = state.cache.export_layers()
    compressed = compressor.compress(full_layers, state.stats)
    compressed_cache, keep = restored(worker, compressed)
    fed = history[-1:] + continuation
    key = tuple(fed)
    if key not in state.reference_rows:
        state.reference_rows[key] = _log_probs(worker, KVCache.from_layers(full_layers, worker.device), fed)
    full_rows = state.reference_rows[key]
    compressed_rows = _log_probs(worker, compressed_cache, fed, keep)
    totals = FidelityTotals(stored_bytes=compressed.stored_bytes, history_tokens=len(history) - 1,
                            full_bytes=sum(k.nbytes + v.nbytes for k, v in full_layers))
    for begin, end in scored:
        positions = torch.arange(begin, end)  # row i of `fed` predicts continuation[i]
        targets = torch.tensor(continuation[begin:end])
        p_full, p_comp = full_rows[positions], compressed_rows[positions]
        totals.tokens += end - begin
        totals.agreements += int((p_full.argmax(-1) == p_comp.argmax(-1)).sum())
        totals.kl_sum += float((p_full.exp() * (p_full - p_comp)).sum())
        totals.logprob_full += float(p_full.gather(1, targets[:, None]).sum())
        totals.logprob_compressed += float(p_comp.gather(1, targets[:, None]).sum())
    return totals


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
    rows = _log_probs(worker, scoring_cache, rest + fact_tokens, keep)
    fact_rows = rows[len(rest) - 1 : len(rest) - 1 + len(fact_tokens)]
    fact_logprob = float(fact_rows.gather(1, torch.tensor(fact_tokens)[:, None]).sum())
    return NeedleResult(needle.fact.lower() in answer.lower(), fact_logprob, answer, compressed.stored_bytes,
                        len(history) - 1)


@torch.inference_mode()
def answer_needle(worker: ModelWorker, state: KVCache, rest: list[int], keep: torch.Tensor | None = None,
                  max_tokens: int = 12) -> list[int]:
    generated = []
    rows = _log_probs(worker, state, rest, keep)
    for _ in range(max_tokens):
        token = int(rows[-1].argmax())
        if token in worker.stop_token_ids:
            break
        generated.append(token)
        rows = _log_probs(worker, state, [token], keep)
    return generated


# -- ShareGPT continuations ------------------------------------------------------------------------

@dataclass(slots=True)
class ContinuationCase:
    history: list[int]
    continuation: list[int]
    spans: list[tuple[int, int]]  # assistant tokens within `continuation`


def sharegpt_cases(formatter: ChatFormatter, conversations, target_tokens: int, count: int, end_of_turn: int,
                   max_reply_tokens: int = 256) -> list[ContinuationCase]:
    """For each conversation, the first turn t whose history reaches about `target_tokens`; the real
    next user turn and assistant reply are the continuation (the reply capped at `max_reply_tokens`)."""
    cases = []
    for conversation in conversations:
        messages = [{"role": role, "content": content} for role, content in conversation]
        for turn in range(1, len(messages) // 2):
            history, _ = formatter.append_turns([], [], messages[: 2 * turn], end_of_turn)
            if len(history) < 0.8 * target_tokens:
                continue
            if len(history) <= 1.3 * target_tokens:
                full, spans = formatter.append_turns(history, messages[: 2 * turn],
                                                     messages[2 * turn : 2 * turn + 2], end_of_turn)
                (begin, end), = spans
                end = min(end, begin + max_reply_tokens)
                continuation = full[len(history) : end]
                cases.append(ContinuationCase(history, continuation, [(begin - len(history), end - len(history))]))
            break
        if len(cases) == count:
            break
    return cases


# -- the evaluation run ----------------------------------------------------------------------------

def evaluate(worker: ModelWorker, methods: list[KVCompressor], lengths: list[int], num_conversations: int,
             num_needles: int, log=print) -> list[dict]:
    import time

    from statekeeper.datasets import sharegpt_conversations

    formatter = ChatFormatter(worker.tokenizer)
    end_of_turn = worker.tokenizer.eos_token_id
    rows = []
    for length in lengths:
        cases = sharegpt_cases(formatter, sharegpt_conversations(min_turns=4), length, num_conversations, end_of_turn)
        fillers = (c for c in sharegpt_conversations(min_turns=2) if max(len(m) for _, m in c) < 4000)
        needles = make_needles(num_needles, fillers, formatter, length, seed=length)
        totals = {m.name: FidelityTotals() for m in methods}
        needle_results = {m.name: [] for m in methods}
        compress_seconds = {m.name: 0.0 for m in methods}
        restore_seconds = {m.name: 0.0 for m in methods}
        for index, case in enumerate(cases):
            state = build_state(worker, case.history[:-1])
            reconstruction_seconds = _add_reconstruction(worker, methods, state, case.history[:-1])
            for method in _matched(methods, state):
                if _needs_reconstruction(method):
                    compress_seconds[method.name] += reconstruction_seconds
                started = time.perf_counter()
                compressed = method.compress(state.cache.export_layers(), state.stats)
                compressed_at = time.perf_counter()
                KVCache.from_layers(compressed.restore(), worker.device)
                compress_seconds[method.name] += compressed_at - started
                restore_seconds[method.name] += time.perf_counter() - compressed_at
                totals[method.name].add(compare_continuation(worker, case.history, case.continuation, case.spans,
                                                             method, state))
            log(f"length {length}: conversation {index + 1}/{len(cases)}")
        for index, needle in enumerate(needles):
            history, _ = formatter.append_turns([], [], needle.history, end_of_turn)
            state = build_state(worker, history[:-1])
            _add_reconstruction(worker, methods, state, history[:-1])
            for method in _matched(methods, state):
                needle_results[method.name].append(run_needle(worker, formatter, needle, method, state))
            log(f"length {length}: needle {index + 1}/{len(needles)} "
                + " ".join(f"{m.name}={'ok' if needle_results[m.name][-1].is_correct else 'miss'}" for m in methods))
        for method in methods:
            t, results = totals[method.name], needle_results[method.name]
            rows.append({
                "length": length, "method": method.name, "conversations": len(cases),
                "history_tokens_mean": t.history_tokens / max(1, len(cases)),
                "bytes_per_token": t.bytes_per_token, "full_bytes_per_token": t.full_bytes / max(1, t.history_tokens),
                "top1_agreement": t.top1_agreement, "mean_kl": t.mean_kl, "perplexity_ratio": t.perplexity_ratio,
                "scored_tokens": t.tokens, "needles_correct": sum(r.is_correct for r in results),
                "needles": len(results),
                "fact_logprob_mean": sum(r.fact_logprob for r in results) / max(1, len(results)),
                "compress_ms_mean": 1000 * compress_seconds[method.name] / max(1, len(cases)),
                "restore_ms_mean": 1000 * restore_seconds[method.name] / max(1, len(cases)),
            })
    return rows


def _needs_reconstruction(method: KVCompressor) -> bool:
    inner = getattr(method, "inner", method)
    return getattr(inner, "scorer", None) == "kvzip"


def _add_reconstruction(worker: ModelWorker, methods: list[KVCompressor], state: State, history: list[int]) -> float:
    """KVzip scores for the state, once for every method that needs them; returns the seconds spent."""
    import time

    if not any(_needs_reconstruction(m) for m in methods):
        return 0.0
    started = time.perf_counter()
    state.stats.reconstruction = worker.reconstruction_scores(state.cache, history)
    return time.perf_counter() - started


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
    lines = ["| history | method | stored bytes/token (×full) | top-1 agreement | mean KL | PPL ratio | needles | "
             "fact log-prob | compress ms | restore ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| ~{r['length']:,} ({r['history_tokens_mean']:.0f}) | {r['method']} | {r['bytes_per_token']:.0f} "
            f"({r['bytes_per_token'] / r['full_bytes_per_token']:.3f}) | {r['top1_agreement']:.4f} | "
            f"{r['mean_kl']:.5f} | {r['perplexity_ratio']:.4f} | {r['needles_correct']}/{r['needles']} | "
            f"{r['fact_logprob_mean']:.3f} | {r['compress_ms_mean']:.1f} | {r['restore_ms_mean']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import sys
    from pathlib import Path

    from statekeeper.compression import by_name
    from statekeeper.config import WorkerConfig
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
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calibration", type=int, default=8,
                        help="conversations that rank layer pairs for the damage methods (not evaluated)")
    parser.add_argument("--profile", help="a HeadProfile (statekeeper calibrate) for the -calibrated methods")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), num_threads=args.threads)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    lengths = [int(x) for x in args.lengths.split(",")]
    names = args.methods.split(",")
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    damage = calibrate_damage(worker, names, args.calibration, lengths[0], log)
    rankings = {part: [pair for pair, _ in ranked] for part, ranked in damage.items()}
    profile = None
    if args.profile:
        from statekeeper.calibration import HeadProfile

        profile = HeadProfile.from_json(Path(args.profile).read_text())
    methods = [by_name(name, args.ratio, args.gamma, rankings, profile) for name in names]
    rows = evaluate(worker, methods, lengths, args.conversations, args.needles, log=log)
    print(format_table(rows))
    if damage:
        print("\nDamage ranking (mean KL when the pair shares alone), least damaging first:")
        for part, ranked in damage.items():
            print(f"- {part}: " + ", ".join(f"{i}+{j} {kl:.4f}" for (i, j), kl in ranked))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "damage": damage}, indent=1))


CALIBRATION_SKIP = 3000  # calibration conversations come from far beyond those the evaluation reads


def damage_parts(names: list[str]) -> list[str]:
    """What the `damage` methods among `names` share ("v", "k", "kv"), each needing its own ranking."""
    sharing = [name.partition("+")[0].partition("/")[0].partition("@")[0] for name in names]  # e.g. damage-kv
    return sorted({(spec.partition("-")[2] or "v") for spec in sharing if spec.startswith("damage")})


def calibrate_damage(worker: ModelWorker, names: list[str], count: int, length: int, log) -> dict:
    import itertools

    from statekeeper.calibration import pair_damage
    from statekeeper.datasets import sharegpt_conversations

    parts = damage_parts(names)
    if not parts:
        return {}
    formatter = ChatFormatter(worker.tokenizer)
    conversations = itertools.islice(sharegpt_conversations(min_turns=4), CALIBRATION_SKIP, None)
    cases = sharegpt_cases(formatter, conversations, length, count, worker.tokenizer.eos_token_id)
    return pair_damage(worker, cases, parts, log=log)
