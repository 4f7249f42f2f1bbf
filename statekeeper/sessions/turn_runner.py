"""One turn, or one scoring, of a conversation the session service has found: the slot it holds (the
conversation, a turn slot, the tenant's count, the replicas' lease, a pause on compression), the limits its
request must fit, restoring the KV and running the token loop (turns.py), and committing the history. The
history changes only when a turn completes; the KV always matches it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

import anyio
import torch

from statekeeper.chat import ChatFormatter, TemplateRefused
from statekeeper.config import SessionConfig
from statekeeper.history import Conversation, HistoryConflict, HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.sessions.errors import (ContentTooLarge, ContextOverflow, InvalidRequest, Overloaded,
                                         SessionNotFound, TurnInProgress, as_refusal)
from statekeeper.sessions.executors import Executors, to_the_end
from statekeeper.sessions.kv_restore import KVRestorer
from statekeeper.sessions.live import LiveSession, utc_now
from statekeeper.sessions.placement_feed import PlacementFeed
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.tenants import TenantGuard
from statekeeper.sessions.turns import Generation, ScoreResult, TokenScore, TurnDelta, TurnRequest, TurnResult, generate
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)


class TurnRunner:
    def __init__(self, worker: ModelWorker, formatter: ChatFormatter, config: SessionConfig, history: HistoryStore,
                 executors: Executors, restorer: KVRestorer, tenants: TenantGuard, replicas: ReplicaSync,
                 cancel_compression: Callable[[str], None], record_turn: Callable[[TurnResult], None],
                 feed: PlacementFeed, prepared_ahead: Callable[[LiveSession], tuple | None] = lambda live: None):
        """`record_turn(result)`: counts a committed turn in the service's metrics and charts; `feed` tells the
        placement policy (and the traffic trace) of each turn; `prepared_ahead(live)`: a state prepared before a
        midnight that the date change has not taken up yet (NextTurnState.take_ahead_for_turn)."""
        self.worker = worker
        self.formatter = formatter
        self.config = config
        self.history = history
        self.executors = executors
        self._restore = restorer.restore  # where a turn's KV comes from (sessions/kv_restore.py)
        self._restore_prefix = restorer.restore_prefix
        self.tenants = tenants
        self.replicas = replicas
        self._cancel_compression = cancel_compression
        self._record_turn = record_turn
        self.feed = feed
        self._prepared_ahead = prepared_ahead
        self.in_progress = 0  # turns and scorings under way
        self.last_turn_ended = 0.0  # time.monotonic()
        self.quiet = asyncio.Event()  # set while no turn runs (background compression waits for it)
        self.quiet.set()

    @contextlib.asynccontextmanager
    async def slot(self, live: LiveSession):
        """Marks a turn (or scoring) under way: this conversation's pending compression is cancelled and
        background compression everywhere waits until no turn runs."""
        tenant = live.conversation.tenant
        if self.tenants.limits.stored_bytes:
            await self.executors.in_io_thread(self.tenants.check_stored_bytes, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        if self.in_progress >= self.config.max_concurrent_turns:
            raise Overloaded(f"{self.in_progress} turns are under way, the most this service takes at once")
        with self.tenants.turn(tenant):
            live.in_turn = True
            if live.preparing is not None:  # a background re-prefill holds the lock: it gives way now
                live.preparing.cancel()
            self._cancel_compression(live.id)
            self.in_progress += 1
            self.quiet.clear()
            try:
                waiting = time.perf_counter()
                async with live.lock:
                    live.lock_wait_ms = (time.perf_counter() - waiting) * 1000
                    if live.deleted:  # deleted while this request waited for the session
                        raise SessionNotFound(f"session {live.id} not found")
                    async with self.replicas.lease(live):
                        await self.replicas.refresh(live)  # another replica may have moved it on
                        yield
            finally:
                live.in_turn = False
                live.last_used = self.last_turn_ended = time.monotonic()
                self.in_progress -= 1
                if self.in_progress == 0:
                    self.quiet.set()

    async def _commit(self, live: LiveSession, updated: Conversation, kv_before: int, biases: tuple) -> bool:
        """Saves a finished turn. Once the save has started it commits in its thread whatever happens to
        the caller, so a client that goes away meanwhile (its task cancelled) waits here, still holding the
        session, until it has: memory then follows what was committed, instead of keeping the old history
        that the next turn would save over the committed one. Returns whether the client left meanwhile (the
        turn happened: the caller records it, then ends the cancelled task)."""
        save = asyncio.ensure_future(self.executors.in_io_thread(self.history.commit_turn, updated, live.conversation.turns,
                                                       live.fence))
        cancelled = False
        try:
            await to_the_end(save)  # the client left meanwhile: it waited on, the save commits regardless
        except asyncio.CancelledError:
            cancelled = True
        except Exception:  # noqa: S110 - the save failed: handled below
            pass
        # A cancel the wait's shield held back (anyio's: its scope is cancelled, the deadline past) is the client's too
        cancelled = cancelled or anyio.current_effective_deadline() == -math.inf
        failed = save.cancelled() or save.exception() is not None
        if failed:
            _roll_back(live.cache, kv_before, biases)  # the history is unchanged: so must the KV be
        else:
            live.conversation = updated
        if not save.cancelled() and isinstance(save.exception(), HistoryConflict):
            # Another replica moved it on (follow the stored one) or deleted it (SessionNotFound, forgotten here)
            await self.replicas.refresh(live)
        if failed and (cancelled or save.cancelled()):
            raise asyncio.CancelledError
        if failed:
            raise as_refusal(save.exception())
        return cancelled

    def check_request(self, request: TurnRequest) -> list[str]:
        """Refuses a turn whose texts or max_tokens are over the limits; returns its new texts."""
        new_texts = [request.content, *(message["content"] for message in request.preceding)]
        new_texts += [call["function"]["arguments"] for message in request.new_messages
                      for call in message.get("tool_calls", ())]
        if request.tools:  # rendered into the prompt too
            new_texts.append(json.dumps(request.tools, ensure_ascii=False))
        for content in new_texts:
            self.check_content(content)
        if request.max_tokens is not None and request.max_tokens > self.config.max_tokens_limit:
            raise ContextOverflow(f"max_tokens is limited to {self.config.max_tokens_limit}")
        return new_texts

    def check_room(self, history_tokens: int, new_texts: list[str], reply_tokens: int) -> None:
        """Refuses new text that cannot fit the context whatever its tokens, before it is rendered and
        tokenized on the event loop (work that grows with what the client sent)."""
        least = history_tokens + self.formatter.min_tokens(new_texts) + reply_tokens
        if least > self.worker.context_length:
            raise ContextOverflow(f"the conversation would need at least {least} tokens, over the model's context "
                                  f"of {self.worker.context_length}")

    def teacher_forced_tokens(self, conversation: Conversation, messages: list[dict]):
        """`messages` appended to the conversation as its turns would render them (its tools, its template
        options): the tokens and the spans of the replies."""
        tokens = conversation.tokens
        for message in messages:
            self.check_content(message["content"])
        self.check_room(len(tokens), [message["content"] for message in messages], 0)
        try:
            return self.formatter.append_turns(tokens, conversation.chat_messages(), messages,
                                               self.worker.tokenizer.eos_token_id, conversation.tools,
                                               conversation.template_options)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    def _tool_calls(self, text: str, request: TurnRequest) -> tuple[str, list[dict] | None]:
        """The reply's text before its tool calls and the calls, where the turn lets the model call tools
        and the reply is calls in the template's format; else the whole text and None."""
        format_ = self.formatter.tool_call_format if request.parse_tool_calls else None
        if format_ is None:
            return text, None
        parsed = format_.parse(text, {tool["function"]["name"] for tool in request.tools or ()})
        if not parsed.tool_calls:
            return text, None
        return parsed.content, parsed.tool_calls if request.parallel_tool_calls else parsed.tool_calls[:1]

    def check_content(self, content: str) -> None:
        if len(content) > self.config.max_content_chars:
            raise ContentTooLarge(f"content has {len(content)} characters; the maximum is {self.config.max_content_chars}")

    async def score(self, live: LiveSession, messages: list[dict]) -> ScoreResult:
        """Scores `messages` appended to the session's state with teacher forcing; the session (history
        and KV) is left as it was."""
        async with self.slot(live):
            conversation = live.conversation  # as the slot found it: another replica may have moved it on
            tokens, spans = await self.executors.in_template_thread(self.teacher_forced_tokens, conversation,
                                                                    messages)
            if len(tokens) > self.worker.context_length:
                raise ContextOverflow(f"scoring needs {len(tokens)} tokens, over the context of "
                                      f"{self.worker.context_length}")
            restore_source, restore_ms, _ = await self._restore(live, conversation.tokens)
            cache = live.cache
            kv_before = cache.num_tokens
            # The token before the first scored one must be fed: if the cache already holds it, its KV
            # row is set aside and put back afterwards, so the session's KV stays bit-identical.
            start = max(0, min(kv_before, len(conversation.tokens) - 1))
            saved, biases = cache.copy_range(start, kv_before), cache.biases
            # As a turn would: the messages before the first scored token in one forward, attending every row,
            # the rest in the next, attending what the reply would (KVCache.reply_bias). Split whatever the
            # cache's bias, so that two states holding the same rows score the same: a forward's rounding
            # depends on how many rows it runs (the GEMM's blocking, its kernel below the measured crossover).
            reply_from = spans[0][0] - start if spans else None
            try:
                cache.truncate(start)
                logprobs, greedy = await self.executors.in_model_thread(self.worker.score, cache, tokens[start:],
                                                                        reply_from, tokens=len(tokens) - start)
            finally:
                cache.truncate(start)
                cache.append(saved)
                cache.restore_biases(biases)
        scores = [
            TokenScore(tokens[i], float(logprobs[i - start - 1]), int(greedy[i - start - 1]))
            for begin, end in spans
            for i in range(begin, end)
        ]
        return ScoreResult(scores, restore_source, restore_ms)

    async def run(self, live: LiveSession, request: TurnRequest) -> AsyncIterator[TurnDelta | TurnResult]:
        if request.continues is not None and len(live.conversation.chat_messages()) != request.continues:
            raise TurnInProgress("the conversation moved on since the request's history was matched to it")
        started, started_at = time.perf_counter(), time.time()
        stopped, live.stopped_preparation = live.stopped_preparation, None  # this turn's to use, or no one's
        conversation = live.conversation
        self.feed.turn_started(live.id)
        new_messages = request.new_messages
        try:
            extension = await self.executors.in_template_thread(
                self.formatter.extend, conversation.tokens, conversation.chat_messages() + new_messages,
                request.tools, request.template_options)
        except TemplateRefused as exc:
            raise InvalidRequest(str(exc)) from None
        prompt = extension.tokens
        if request.max_tokens is None:  # as many as the context has room for, within the service's limit
            room = max(1, min(self.config.max_tokens_limit, self.worker.context_length - len(prompt)))
            request = dataclasses.replace(request, max_tokens=room)
        if len(prompt) + request.max_tokens > self.worker.context_length:
            raise ContextOverflow(
                f"the conversation would need {len(prompt)} prompt tokens + max_tokens {request.max_tokens}, "
                f"over the model's context of {self.worker.context_length}"
            )
        if extension.is_append_only:
            restore_source, restore_ms, logits = await self._restore(live, conversation.tokens, prompt)
        else:  # the template rewrote an earlier turn: the KV of the tokens both renderings share is kept
            log.info("chat template rewrote the history of %s: keeping the KV of its first %d of %d tokens",
                     live.id, extension.common, len(conversation.tokens))
            restore_source, restore_ms = await self._restore_prefix(live, conversation.tokens, extension.common, prompt,
                                                                    stopped, self._prepared_ahead(live))
            logits = None
        cache = live.cache
        # The KV as it was before this turn: a restore that ran the prompt's prefill already holds more.
        kv_before = live.stored_tokens if logits is not None else cache.num_tokens
        # What a turn that does not happen leaves: the rows the history's own tokens hold. Past the renderings'
        # parting, rows taken from a preparation (stopped, or its early head) are the next rendering's.
        kv_kept = kv_before if extension.is_append_only else min(kv_before, extension.common)
        biases = cache.biases  # a restore's working set waits for the reply (KVCache.begin_reply)
        done: list[Generation] = []
        waits: list[float] = []  # each model job's wait in line: the first one's is before the first token

        stream = object()  # this turn, to the batch scheduler

        async def step(tokens: list[int]) -> torch.Tensor:
            logits = await self.executors.in_step(stream, (cache, live.stats), tokens, waits)
            cache.begin_reply()  # the prompt (the first step) attended every row a restore read
            return logits

        try:
            live.reply, live.prompt = [], prompt
            deltas = generate(self.worker, self.formatter, step, prompt[kv_before:], request, started, done, logits,
                              finished=lambda: self.executors.end_stream(stream), generated=live.reply)
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield delta
            cache.end_reply()
            reply = done[0]
            # The history keeps the answer, as clients resend it; the tokens (and the KV) keep the whole reply,
            # and a template that drops think blocks makes the next turn keep the KV up to it (restore_prefix).
            answer = self.formatter.split_reasoning(reply.text, request.template_options)
            content, calls = self._tool_calls(answer.content, request)
        except BaseException:  # the client left, or the reply could not be read: no turn happened
            _roll_back(cache, kv_kept, biases)  # the KV must keep matching the unchanged history
            raise
        finally:
            self.executors.end_stream(stream)
        said = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        updated = dataclasses.replace(
            conversation,
            messages=conversation.messages + new_messages + [said],
            tokens=prompt + reply.tokens,
            updated_at=utc_now(),
            tools=request.tools or None,
            template_options=request.template_options or None,
            retention=conversation.retention if request.retention is None else request.retention or None,
        )
        if cache.num_tokens > len(updated.tokens):  # a reply cut at a stop string keeps fewer tokens
            cache.truncate(len(updated.tokens))
        client_left = await self._commit(live, updated, kv_kept, biases)
        self.feed.turn_ended(updated, started_at, len(prompt) - len(conversation.tokens), len(reply.tokens))
        result = TurnResult(
            content=content,
            reasoning=answer.reasoning,
            reasoning_tokens=self.formatter.reasoning_tokens(reply.tokens, answer),
            tool_calls=calls,
            prompt_tokens=len(prompt),
            completion_tokens=len(reply.tokens),
            cached_tokens=kv_before if restore_source != "recompute" else 0,
            restore_source=restore_source,
            restore_ms=restore_ms,
            restore_pipeline=live.last_pipeline if restore_source not in ("active", "recompute") else None,
            restore_layerwise=live.last_layerwise if restore_source not in ("active", "recompute") else None,
            restore_device=live.last_device if restore_source not in ("active", "recompute") else None,
            restore_exact_copy=live.last_exact_copy if restore_source not in ("active", "recompute") else None,
            ttft_ms=reply.ttft_ms,
            total_ms=(time.perf_counter() - started) * 1000,
            lock_wait_ms=live.lock_wait_ms,
            first_queue_ms=waits[0] * 1000 if waits and logits is None else None,
            finish_reason="tool_calls" if calls and reply.finish_reason == "stop" else reply.finish_reason,
        )
        self._record_turn(result)  # committed: the turn happened, whether or not its client stays
        if client_left:
            raise asyncio.CancelledError
        yield result


def _roll_back(cache: KVCache, kv_before: int, biases: tuple) -> None:
    """The KV and what it attends as they were before a turn that did not happen."""
    cache.truncate(kv_before)
    cache.restore_biases(biases)
