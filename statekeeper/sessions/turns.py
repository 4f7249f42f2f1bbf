"""One turn's token loop (prefill of the new message, sampling, streamed text) and what a turn or a
scoring request hands back. The session service restores the KV before and commits the history after."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import torch

from statekeeper.chat import ChatFormatter
from statekeeper.sessions.executors import to_the_end
from statekeeper.worker import ModelWorker


@dataclass(slots=True)
class TurnRequest:
    content: str
    max_tokens: int | None = 256  # None: as many as the context has room for (the service's limit at most)
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # the reply ends before the first of these strings, which it does not include
    preceding: tuple[dict, ...] = ()  # messages that go into the history before the user's (role, content)
    # The new last message where it is more than the user's text (a tool result): `content` is its text.
    message: dict | None = None
    tools: list[dict] | None = None  # functions the model may call, rendered by its chat template
    template_options: dict | None = None  # the chat template's own variables (`chat_template_kwargs`)
    parse_tool_calls: bool = False  # the reply's calls become `tool_calls` (tools offered, tool_choice not "none")
    parallel_tool_calls: bool = True  # False: the first call only
    # The conversation's own retention settings from this turn on (None: unchanged; {}: its tenant's apply),
    # committed with the turn (OpenAI's `prompt_cache_retention`).
    retention: dict | None = None
    # How many messages (the system prompt counted) the conversation held when the client's resent history was
    # matched to it (sessions/resend.py): a turn that finds it moved on since (another replica's turn, a request
    # that came first) is refused, and the match is made again. None: the turn extends it as it is.
    continues: int | None = None

    @property
    def new_messages(self) -> list[dict]:
        return [*self.preceding, self.message or {"role": "user", "content": self.content}]


@dataclass(slots=True)
class TurnDelta:
    text: str


@dataclass(slots=True)
class TurnResult:
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    restore_source: str
    restore_ms: float
    ttft_ms: float
    total_ms: float
    # "stop": an end-of-turn token or a stop string; "length": max_tokens; "tool_calls": the reply is calls
    finish_reason: str = "stop"
    restore_pipeline: dict | None = None  # planned and measured recompute/load split (statekeeper/restore_pipeline.py)
    restore_layerwise: dict | None = None  # a compressed blob decoded behind the prompt's prefill (LayerwiseReport's)
    restore_device: dict | None = None  # on a GPU worker, the device restorer's report (DeviceRestoreReport's)
    restore_exact_copy: str | None = None  # the tier of the exact copy a compressed restore read its entries from
    lock_wait_ms: float = 0.0  # waiting for the session, held by another request (an offload, a compaction)
    first_queue_ms: float | None = None  # the prompt's prefill waiting in line for the model thread
    # A reasoning template's think block, apart from `content`, the answer (ChatFormatter.split_reasoning);
    # None where the template has none.
    reasoning: str | None = None
    reasoning_tokens: int = 0  # of completion_tokens, the think block's (ChatFormatter.reasoning_tokens)
    tool_calls: list[dict] | None = None  # the reply's calls, in OpenAI's shape, as the history keeps them


@dataclass(slots=True)
class TokenScore:
    token: int
    logprob: float
    greedy_token: int

    @property
    def is_match(self) -> bool:
        return self.token == self.greedy_token


@dataclass(slots=True)
class ScoreResult:
    tokens: list[TokenScore]
    restore_source: str
    restore_ms: float

    @property
    def top1_agreement(self) -> float:
        return sum(t.is_match for t in self.tokens) / len(self.tokens)

    @property
    def mean_logprob(self) -> float:
        return sum(t.logprob for t in self.tokens) / len(self.tokens)


@dataclass(slots=True)
class Generation:
    """What the token loop produced; `ttft_ms` counts from the turn's start."""

    tokens: list[int]
    text: str
    ttft_ms: float
    finish_reason: str


class StopStrings:
    """A request's stop strings: where the first one begins in the reply's text, and how much of the text's
    end could still become one (held back from the stream until the next token tells). Each stop string's
    KMP failure function is built once, so the check after a token is linear in the stop strings' length."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stop for stop in stops if stop)
        self._failures = [self._failure(stop) for stop in self.stops]

    @staticmethod
    def _failure(stop: str) -> list[int]:
        """failure[i]: the longest proper prefix of stop[:i + 1] that is also its suffix."""
        failure, matched = [0] * len(stop), 0
        for i in range(1, len(stop)):
            while matched and stop[i] != stop[matched]:
                matched = failure[matched - 1]
            if stop[i] == stop[matched]:
                matched += 1
            failure[i] = matched
        return failure

    def first(self, text: str) -> int | None:
        found = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        return min(found, default=None)

    def held_back(self, text: str) -> int:
        longest = 0
        for stop, failure in zip(self.stops, self._failures):
            matched = 0  # the longest start of `stop` that ends the characters read so far
            for char in text[max(0, len(text) - len(stop) + 1):]:  # only a shorter tail can be a proper prefix
                while matched and char != stop[matched]:
                    matched = failure[matched - 1]
                if char == stop[matched]:
                    matched += 1
            longest = max(longest, matched)
        return longest


def _tokens_of(formatter: ChatFormatter, generated: list[int], text: str) -> list[int]:
    """The longest start of `generated` that decodes to a prefix of `text`: a reply cut at a stop string
    keeps the tokens of what the client got, so its next turn still extends the stored KV."""
    for end in range(len(generated), -1, -1):
        if text.startswith(formatter.decode(generated[:end])):
            return generated[:end]
    return []


async def generate(worker: ModelWorker, formatter: ChatFormatter, step: Callable[[list[int]], Awaitable[torch.Tensor]],
                   new_tokens: list[int], request: TurnRequest, started: float, out: list[Generation],
                   logits: torch.Tensor | None = None, finished: Callable[[], None] = lambda: None,
                   generated: list[int] | None = None) -> AsyncIterator[TurnDelta]:
    """Prefills `new_tokens` (unless the restore already did: then `logits` are its result) and decodes
    the reply, yielding text deltas; `step(tokens)` appends tokens to the turn's KV on the model thread
    (batched with other turns' steps) and returns the logits after the last one. `finished()` is called
    as soon as no more steps will come. The finished Generation is appended to `out`. `generated`, if given,
    gets each token as it is sampled (the reply so far, which the next turn's head follows: sessions/next_turn.py)."""
    generator = None
    if request.temperature > 0:
        generator = torch.Generator().manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
    generated = [] if generated is None else generated
    stops = StopStrings(request.stop)
    sent = ""
    ttft_ms = 0.0
    if logits is None:
        logits = await step(new_tokens)
    next_step = None
    try:
        while True:
            token = worker.sample(logits, request.temperature, request.top_p, generator)
            generated.append(token)
            if len(generated) == 1:
                ttft_ms = (time.perf_counter() - started) * 1000
            is_stop = token in worker.stop_token_ids
            # Special tokens other than the final stop stay in the text, so that rendering the reply
            # through the chat template reproduces exactly the tokens the KV was computed from.
            text = formatter.decode(generated[:-1] if is_stop else generated)
            cut = stops.first(text)
            if cut is not None:
                text, is_stop = text[:cut], True
            is_done = is_stop or len(generated) >= request.max_tokens
            is_whole = is_done or not text.endswith("\ufffd")  # hold back half a UTF-8 character
            shown = text if is_done else text[: len(text) - stops.held_back(text)]
            delta = shown[len(sent) :] if is_whole else ""
            if is_done:
                finished()
            else:  # in line for the next batched step while the caller handles this delta
                next_step = asyncio.ensure_future(step([token]))
            if delta or len(generated) == 1:  # the first token always yields: it marks the TTFT
                yield TurnDelta(delta)
            if is_whole:
                sent = shown
            if is_done:
                break
            # Shielded: a cancel of this turn (uvicorn's, again at each turn of the event loop) reached the step
            # through the await each time, a busy loop that starved the model thread of the GIL
            logits, next_step = await asyncio.shield(next_step), None
    finally:
        if next_step is not None:  # the caller went away: the step must end before its KV is rolled back
            next_step.cancel()  # once: its job is abandoned, and ends at its step's end
            with contextlib.suppress(BaseException):
                await to_the_end(next_step)
    if cut is not None:
        generated = _tokens_of(formatter, generated, sent)
    out.append(Generation(generated, sent, ttft_ms, "stop" if is_stop else "length"))
