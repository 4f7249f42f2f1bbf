"""Teacher-forced comparison of a compressed conversation state with the full one: the measurement
under both the fidelity harness (statekeeper/evaluation/fidelity.py) and calibration.

For a conversation state (history tokens) and a continuation (the next user turn and assistant reply,
teacher-forced), compares the model's next-token distributions with the full KV and with a compressed
KV: top-1 agreement, KL(full || compressed) per token, and the log-probabilities of the scored tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from statekeeper.chat import ChatFormatter
from statekeeper.compression import Compressed, KVCompressor
from statekeeper.compression.attention_stats import AttentionStats, collecting
from statekeeper.kv_cache import KVCache
from statekeeper.worker import ModelWorker


@dataclass(slots=True)
class FidelityTotals:
    tokens: int = 0
    agreements: int = 0
    kl_sum: float = 0.0
    logprob_full: float = 0.0
    logprob_compressed: float = 0.0
    full_hits: int = 0  # scored tokens that are the full KV's top-1
    compressed_hits: int = 0  # ... the compressed KV's top-1
    stored_bytes: int = 0
    full_bytes: int = 0
    history_tokens: int = 0
    live_entries: int = 0  # (layer, head, history token) entries the restored state attends to, before retrieval
    entries: int = 0  # ... of all of them
    drift_events: int = 0  # HeteroCache: pivots whose attention drifted (compression/retrieval.py)
    retrieved_rows: int = 0  # ... and the exact rows their satellites got back
    # Per disagreeing token, full KV's top-1 log-prob minus its runner-up's (nats): 0 is a tie that argmax broke
    # by token id, and a margin within the logits' rounding (bfloat16 logits: 1/32-1/8 at their magnitudes)
    # cannot order the two
    flipped_margins: list = field(default_factory=list)

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

    @property
    def live_fraction(self) -> float:
        return self.live_entries / max(1, self.entries)


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
def log_probs(worker: ModelWorker, cache: KVCache, tokens: list[int], keep: torch.Tensor | None = None):
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
        state.reference_rows[key] = log_probs(worker, KVCache.from_layers(full_layers, worker.device), fed)
    full_rows = state.reference_rows[key]
    totals = FidelityTotals(stored_bytes=compressed.stored_bytes, history_tokens=len(history) - 1,
                            full_bytes=sum(k.nbytes + v.nbytes for k, v in full_layers))
    totals.live_entries, totals.entries = live_entries(compressed, full_layers)
    if compressed.working_set is None:
        compressed_rows = log_probs(worker, compressed_cache, fed, keep)
    else:
        compressed_rows = retrieving_log_probs(worker, compressed_cache, fed, scored[0][0], compressed.working_set)
        totals.drift_events = compressed.working_set.monitor.counters.drift_events
        totals.retrieved_rows = compressed.working_set.monitor.counters.rows
    totals.add(compare_rows(full_rows, compressed_rows, continuation, scored))
    return totals


def live_entries(compressed: Compressed, full_layers) -> tuple[int, int]:
    """(entries the restored state attends to, all (layer, KV head, history token) entries)."""
    entries = sum(keys.shape[0] * keys.shape[1] for keys, _ in full_layers)
    if compressed.working_set is not None:
        return compressed.working_set.live_entries, entries
    if compressed.head_bias is not None:
        return sum(int(torch.isfinite(bias).sum()) for bias in compressed.head_bias), entries
    if compressed.keep is not None:
        return int(compressed.keep.sum()) * entries // len(compressed.keep), entries
    return entries, entries


def retrieving_log_probs(worker: ModelWorker, cache: KVCache, fed: list[int], answer_start: int, working_set,
                         window: int | None = None) -> torch.Tensor:
    """log_probs of `fed` on a HeteroCache working set (compression/hetero.py), checking for drift where the
    service would: after the prompt but its last token (before the answer's first token is predicted), then
    after every `window` answer tokens (the taxonomy's), each time writing the retrieved exact rows before
    the next tokens are fed. With `prompt_exact` the whole prompt (its last token too, which predicts the
    answer's first) attends every history entry of `cache`, exact rows: the working set's bias applies after.
    A working set that does not retrieve is fed at the same cuts (the same forwards) and never checked."""
    monitor, exact = working_set.monitor, working_set.exact
    window = window or monitor.taxonomy.window
    first = answer_start + 1 if working_set.prompt_exact else answer_start
    cuts = [first, *range(first + window, len(fed), window), len(fed)]
    rows, start = [], 0
    if working_set.prompt_exact:  # as the service's restore from an exact copy: the bias waits for the reply
        cache.reply_bias, cache.head_bias = cache.head_bias, None
    with collecting(monitor):
        for cut in cuts:
            if cut <= start:
                continue
            rows.append(log_probs(worker, cache, fed[start:cut]))
            start = cut
            cache.begin_reply()
            if cut < len(fed) and working_set.retrieve:
                retrieved = [(r.layer, r.head, r.positions, exact[r.layer][0][r.head, r.positions],
                              exact[r.layer][1][r.head, r.positions]) for r in monitor.check(exact)]  # pivots exact
                cache.write_rows(retrieved)
                monitor.counters.bytes += sum(keys.nbytes + values.nbytes for _, _, _, keys, values in retrieved)
    return torch.cat(rows)


def compare_rows(full_rows: torch.Tensor, compressed_rows: torch.Tensor, continuation: list[int],
                 scored: list[tuple[int, int]]) -> FidelityTotals:
    """The metrics on the `scored` spans of `continuation`, whose token i row i of each log-prob table
    predicts: full is the reference, compressed the one judged (a compressed KV, or other weights)."""
    totals = FidelityTotals()
    for begin, end in scored:
        positions = torch.arange(begin, end)
        targets = torch.tensor(continuation[begin:end])
        p_full, p_comp = full_rows[positions], compressed_rows[positions]
        totals.tokens += end - begin
        agree = p_full.argmax(-1) == p_comp.argmax(-1)
        totals.agreements += int(agree.sum())
        top = p_full[~agree].topk(2, dim=-1).values
        totals.flipped_margins += (top[:, 0] - top[:, 1]).tolist()
        totals.full_hits += int((p_full.argmax(-1) == targets).sum())
        totals.compressed_hits += int((p_comp.argmax(-1) == targets).sum())
        totals.kl_sum += float((p_full.exp() * (p_full - p_comp)).sum())
        totals.logprob_full += float(p_full.gather(1, targets[:, None]).sum())
        totals.logprob_compressed += float(p_comp.gather(1, targets[:, None]).sum())
    return totals


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
    if count <= 0:
        return cases
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
