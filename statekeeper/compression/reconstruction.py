"""KVzip's context-reconstruction scores with one attention per layer instead of two.

KVzip (Kim et al. 2025, §3): the model is prompted to repeat the history ("Repeat the previous context
exactly."), the history is teacher-forced after the prompt on top of its own KV, and each history
(KV head, token) entry is scored by the most attention it receives from any repeating query (max over
the query heads of its GQA group). The reference collector (attention_stats.ReconstructionScores) does
this next to the model's SDPA: a second q·Kᵀ and a softmax over every key, for every repeating query.
Here (ReconstructionScoring says which options a scoring uses):
- one attention instead of two: the repeating queries' attention runs once in CPU flash SDPA, which also
  returns each query row's log-sum-exp; the probability a history key receives is then
  exp(q·k·s + bias − lse), one matmul over the history columns and a max, with no second softmax and
  the same scores as the reference (to float rounding);
- the forward stops after the last layer's attention: nothing after it is read;
- optionally, chunked repetition (KVzip §3.3): the history is repeated `context_chunk_tokens` at a time,
  each chunk after its own prompt, the cache cropped back to the history in between, so a repeating
  query attends to the history plus its own chunk instead of the history plus everything repeated so far;
- optionally, the scoring forward's linear layers in int8 (kernels/int8_linear.py): the scores are a
  ranking, so they need not be exact; the live model never runs this way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

PROMPT = "\n\nRepeat the previous context exactly.\n"
SINK_TOKENS = 4  # history tokens every windowed query also sees (the attention sink)


@dataclass(frozen=True, slots=True)
class ReconstructionScoring:
    """How the worker makes KVzip scores: `fused` (one attention, this module) or the reference collector;
    the history repeated `context_chunk_tokens` at a time after its own prompt, or all at once (None)."""

    fused: bool = True
    context_chunk_tokens: int | None = None
    int8_linears: bool = False  # the scoring forward's linear layers in int8 (kernels/int8_linear.py; CPU only)
    # A repeating query attends only to the history within this many tokens of the position it repeats
    # (and the first SINK_TOKENS), the prompt and the last this-many repeated tokens; None: to everything.
    window_tokens: int | None = None

    def __post_init__(self):
        if self.context_chunk_tokens is not None and self.context_chunk_tokens < 16:
            raise ValueError("context_chunk_tokens must be >= 16")
        if self.int8_linears and not self.fused:
            raise ValueError("int8_linears applies to the fused scoring only")
        if not self.fused and self.context_chunk_tokens is not None:
            raise ValueError("the reference scoring repeats the whole history at once")
        if self.window_tokens is not None and (not self.fused or self.context_chunk_tokens or self.window_tokens < 16):
            raise ValueError("window_tokens (>= 16) applies to the fused scoring of the whole history")

    @property
    def name(self) -> str:
        """`reference`, or `fused-c<N>` (`-c0`: the whole history at once) with `-w<N>` and `-int8`."""
        if not self.fused:
            return "reference"
        return (f"fused-c{self.context_chunk_tokens or 0}" + (f"-w{self.window_tokens}" if self.window_tokens else "")
                + ("-int8" if self.int8_linears else ""))

    @classmethod
    def by_name(cls, name: str) -> "ReconstructionScoring":
        match = re.fullmatch(r"reference|fused-c(?P<chunk>\d+)(?:-w(?P<window>\d+))?(?P<int8>-int8)?", name)
        if match is None:
            raise ValueError(f"unknown scoring {name!r}: reference or fused-c<N>[-w<N>][-int8]")
        if name == "reference":
            return cls(fused=False, context_chunk_tokens=None)
        window = int(match["window"]) if match["window"] else None
        return cls(True, int(match["chunk"]) or None, bool(match["int8"]), window)


# The service's: one attention, the whole history repeated at once (chunked repetition lost 0.4 points of
# recall top-1 in a screen), int8 linears (the same top-1, needles and recall as the reference in that
# screen). BENCHMARKS.md "Scoring at about one prefill".
DEFAULT_SCORING = ReconstructionScoring(fused=True, context_chunk_tokens=None, int8_linears=True)
REFERENCE_SCORING = ReconstructionScoring(fused=False, context_chunk_tokens=None)  # before issue 13


@dataclass(slots=True)
class ReconstructionStep:
    """Tokens fed in one model-thread job. A step that starts a repetition chunk crops the cache back to
    the history first (the chunk before it is not attended)."""

    tokens: list[int]
    is_chunk_start: bool = False
    history_start: int = 0  # the history position the first token repeats (negative: prompt tokens)


def plan_steps(history: list[int], prompt: list[int], job_tokens: int,
               context_chunk_tokens: int | None) -> list[ReconstructionStep]:
    """`prompt + chunk` for each repetition chunk of `history` (one chunk: all of it), cut into steps of
    at most `job_tokens`."""
    size = context_chunk_tokens or max(1, len(history))
    steps = []
    for start in range(0, len(history), size):
        fed = prompt + history[start : start + size]
        steps += [ReconstructionStep(fed[i : i + job_tokens], i == 0 and start > 0, start + i - len(prompt))
                  for i in range(0, len(fed), job_tokens)]
    return steps


class ForwardDone(Exception):
    """Raised after the last layer's attention while scoring: the rest of the forward is not needed."""


@dataclass(slots=True)
class FusedReconstructionScores:
    """Collects KVzip scores from the attention it computes itself (the "statekeeper" attention function
    hands it the layer's query, keys and values while it is the active collector)."""

    num_layers: int
    history_tokens: int
    int8_linears: bool = False  # read by the worker: the forward runs its linears in int8
    window_tokens: int | None = None  # ReconstructionScoring.window_tokens
    prompt_tokens: int = 0  # the prompt's length (it follows the history in the cache)
    step_history_start: int = 0  # ReconstructionStep.history_start of the step being fed (set by the worker)
    scores: list = field(init=False)  # per layer [kv_heads, history_tokens]
    _history_keys: list = field(init=False)  # per layer, augmented_keys of the history (unchanged while scoring)

    def __post_init__(self):
        self.scores = [None] * self.num_layers
        self._history_keys = [None] * self.num_layers

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               bias: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The layer's attention output ([1, s, Hq, d], as the attention function returns it), recording
        the scores on the way; raises ForwardDone after the last layer."""
        kv_heads, (_, query_heads, num_queries, head_dim) = key.shape[1], query.shape
        rows = query[0].reshape(kv_heads, query_heads // kv_heads * num_queries, head_dim)
        if self.window_tokens is not None:
            output = self._attend_window(layer, rows, key, value, bias, scaling, num_queries)
        else:
            output, lse = attention_with_lse(rows, key, value, bias, scaling, num_queries)
            if self._history_keys[layer] is None:
                self._history_keys[layer] = augmented_keys(key, self.history_tokens)
            best = history_probability_max(rows, key, lse, bias, scaling, self.history_tokens,
                                           self._history_keys[layer])
            previous = self.scores[layer]
            self.scores[layer] = best if previous is None else torch.maximum(previous, best)
        if layer == self.num_layers - 1:
            raise ForwardDone
        grouped = output.reshape(kv_heads, query_heads // kv_heads, num_queries, -1)
        return grouped.permute(2, 0, 1, 3).reshape(1, num_queries, query_heads, -1)

    def _attend_window(self, layer, rows, key, value, bias, scaling, num_queries) -> torch.Tensor:
        """Windowed attention: the keys a step's queries see are gathered (history window and sinks, the
        prompt, recent repeated tokens, their own), the softmax is over those only, and only the gathered
        history keys receive a probability from this step."""
        history, window = self.history_tokens, self.window_tokens
        before = key.shape[2] - num_queries
        start = max(0, self.step_history_start)
        low, high = max(0, start - window), min(history, start + num_queries + window)
        prompt_end = history + self.prompt_tokens
        seen_history = torch.cat([torch.arange(min(SINK_TOKENS, low)), torch.arange(low, high)])
        seen = torch.cat([seen_history, torch.arange(history, min(prompt_end, before)),
                          torch.arange(min(before, max(prompt_end, before - window)), before),
                          torch.arange(before, key.shape[2])]).to(key.device)
        keys, values = key.index_select(2, seen), value.index_select(2, seen)
        seen_bias = None
        if bias is not None:
            seen_bias = torch.zeros(bias.shape[0], len(seen), dtype=bias.dtype, device=bias.device)
            seen_bias[:, : len(seen_history)] = _head_bias(bias, history, bias.dtype)[:, seen_history]
        output, lse = attention_with_lse(rows, keys, values, seen_bias, scaling, num_queries)
        best = history_probability_max(rows, keys, lse, seen_bias, scaling, len(seen_history))
        if self.scores[layer] is None:
            self.scores[layer] = best.new_zeros(best.shape[0], history)
        scores = self.scores[layer]
        scores[:, seen_history] = torch.maximum(scores[:, seen_history], best)
        return output


# Query rows: the [1, Hq, s, d] queries of a GQA layer as [Hkv, G * s, d], query head h * G + g's query i
# at row g * s + i of KV head h (a view of contiguous queries), so that K and V are never repeated.

def _causal_rows(groups: int, num_queries: int, num_keys: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[G * s, n] additive causal mask for query rows: row g * s + i sees keys <= n - s + i."""
    allowed = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)
    mask = torch.zeros(num_queries, num_keys, dtype=dtype, device=device).masked_fill_(~allowed, -math.inf)
    return mask.repeat(groups, 1)


def _head_bias(bias: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, n]: a bias of any width, zero past it."""
    head_bias = torch.zeros(bias.shape[0], num_keys, dtype=dtype, device=bias.device)
    covered = min(bias.shape[1], num_keys)
    head_bias[:, :covered] = bias[:, :covered]
    return head_bias


def attention_with_lse(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor | None,
                       scaling: float, num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of query rows [Hkv, G * s, d] (the queries of the last s = `num_queries` of the n
    keys) over [1, Hkv, n, d] keys and values, with an optional [Hkv, *] bias (a restored state's
    evictions and votes; any width, zero past it): (output rows [Hkv, G * s, d], log-sum-exp [Hkv, G * s]
    of the scaled, biased, masked logits).

    On CPU, flash SDPA in two parts merged by their log-sum-exps: the keys before the queries' own, which
    every query row sees (no causal mask: only the bias, broadcast over the rows), and the queries' own
    s keys (causal). Elsewhere, or with a bias on the queries' own keys, `attention_with_lse_reference`."""
    kv_heads, num_rows, _ = rows.shape
    num_keys = key.shape[2]
    before = num_keys - num_queries
    if rows.device.type != "cpu" or bias is not None and bool(bias[:, before:num_keys].any()):
        return attention_with_lse_reference(rows, key, value, bias, scaling, num_queries)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own_mask = _causal_rows(num_rows // num_queries, num_queries, num_queries, rows.dtype, rows.device)
    own, own_lse = flash(rows[None], key[:, :, before:], value[:, :, before:], attn_mask=own_mask[None, None],
                         scale=scaling)
    if not before:
        return own[0], own_lse[0]
    mask = None if bias is None else _head_bias(bias, before, rows.dtype)[None, :, None, :]
    seen, seen_lse = flash(rows[None], key[:, :, :before], value[:, :, :before], attn_mask=mask, scale=scaling)
    total = torch.logaddexp(seen_lse, own_lse)
    output = seen * (seen_lse - total).exp()[..., None] + own * (own_lse - total).exp()[..., None]
    return output[0].to(rows.dtype), total[0]


def attention_with_lse_reference(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 bias: torch.Tensor | None, scaling: float,
                                 num_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain version: logits of every row against every key in fp32, the causal mask and the bias
    added, log-sum-exp and softmax."""
    groups, num_keys = rows.shape[1] // num_queries, key.shape[2]
    logits = torch.matmul(rows.float(), key[0].float().transpose(1, 2)) * scaling  # [Hkv, rows, n]
    logits += _causal_rows(groups, num_queries, num_keys, torch.float32, rows.device)[None]
    if bias is not None:
        logits += _head_bias(bias, num_keys, torch.float32)[:, None, :]
    output = torch.matmul(torch.softmax(logits, dim=-1), value[0].float())
    return output.to(rows.dtype), torch.logsumexp(logits, dim=-1)


def augmented_keys(key: torch.Tensor, history_tokens: int) -> torch.Tensor:
    """[Hkv, T, d + 1]: the history's keys in fp32 with a 1 appended (see history_probability_max)."""
    history = key[0, :, :history_tokens].float()
    return torch.cat([history, history.new_ones(history.shape[:2] + (1,))], dim=-1)


def history_probability_max(rows: torch.Tensor, key: torch.Tensor, lse: torch.Tensor, bias: torch.Tensor | None,
                            scaling: float, history_tokens: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """[Hkv, history]: per KV head and history key, the largest attention probability any of its query
    rows gave it: exp(max_r (q_r·k·s − lse_r) + bias_k). Every repeating query sits after the history, so
    no causal mask applies to these columns; the softmax's normaliser is `lse`. One matmul: the rows
    carry −lse as an extra coordinate and the keys a 1 (no [rows, history] pass to subtract it); `keys`:
    augmented_keys(key, history_tokens) if the caller has it."""
    keys = augmented_keys(key, history_tokens) if keys is None else keys
    queries = torch.cat([rows.float() * scaling, -lse[..., None].float()], dim=-1)  # [Hkv, rows, d + 1]
    best = torch.bmm(queries, keys.transpose(1, 2)).amax(dim=1)
    if bias is not None:
        best += _head_bias(bias, history_tokens, torch.float32)
    return best.exp()
