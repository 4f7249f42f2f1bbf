"""Session service: conversations, their lifecycle (active <-> inactive) and turns.

Active: the KV lives in the worker. Inactive: it was serialized into a storage tier (or dropped; the
history in LMDB always remains, so the state can be recomputed). Model calls run on one model thread,
one forward at a time; turns of different sessions interleave step by step in arrival order (fair)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from pathlib import Path
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from statekeeper.chat import ChatFormatter
from scheduler.model_thread import ModelThread
from scheduler.plan import RestorePlan, StoredLayer, plan_restore
from statekeeper.compression.head_profile import HeadProfile, load_profile
from statekeeper.compression import from_config as compressor_from_config
from statekeeper.compression import restore_state
from statekeeper.compression.transcode import effective_codec
from statekeeper.profile import HardwareProfile
from statekeeper.restore import restore_pipelined
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.config import CompressionConfig, SessionConfig
from statekeeper.history import Conversation, HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


class SessionError(Exception):
    status = 400


class SessionNotFound(SessionError):
    status = 404


class TurnInProgress(SessionError):
    status = 409


class ContentTooLarge(SessionError):
    status = 413


class ContextOverflow(SessionError):
    status = 400


@dataclass(slots=True)
class TurnRequest:
    content: str
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


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
    restore_pipeline: dict | None = None  # planned and measured recompute/load split (statekeeper/restore.py)


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


class InvalidRequest(SessionError):
    status = 422


@dataclass(slots=True)
class SessionView:
    id: str
    state: str
    tier: str | None
    turns: int
    tokens: int
    stored_bytes: int | None
    compression: str
    codec: str


@dataclass(eq=False)
class LiveSession:
    conversation: Conversation
    cache: KVCache | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_turn: bool = False
    last_used: float = field(default_factory=time.monotonic)
    stats: AttentionStats | None = None  # gathered while the KV is active, for compression at offload
    last_pipeline: dict | None = None  # the last restore's recompute/load report, if it split the work

    @property
    def id(self) -> str:
        return self.conversation.id


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


class SessionService:
    def __init__(self, worker: ModelWorker, history: HistoryStore, tiers: TierManager, config: SessionConfig,
                 profile_dir: Path | None = None, hardware: HardwareProfile | None = None,
                 tier_codecs: dict[str, str] | None = None):
        self.worker = worker
        self.tier_codecs = dict(tier_codecs or {})  # tier name -> the codec a blob is re-encoded to there
        self.hardware = hardware  # restore planning; None loads every stored token
        self.profile_dir = profile_dir
        self._profiles: dict[str, HeadProfile | None] = {}
        self.history = history
        self.tiers = tiers
        self.config = config
        self.formatter = ChatFormatter(worker.tokenizer)
        self._live: dict[str, LiveSession] = {}
        self._model_thread = ModelThread()  # live steps before background compression work
        self._io_threads = ThreadPoolExecutor(2, thread_name_prefix="statekeeper-io")
        self._sweeper: asyncio.Task | None = None
        self._tasks: set[asyncio.Future] = set()
        self._reconcile_tiers()

    # -- lifecycle ---------------------------------------------------------------------------------

    def _reconcile_tiers(self) -> None:
        """Blobs whose conversation no longer exists (deleted while the process died) are orphans. A
        shared tier's unknown keys may belong to another replica and are left alone."""
        known = set(self.history.ids())
        for key in self.tiers.private_keys() - known:
            log.info("removing orphan KV blob %s", key)
            self.tiers.delete(key)

    async def start(self) -> None:
        await self.warm_up()
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def warm_up(self) -> None:
        """Runs the restore path once on every thread, so the first user does not pay for lazy
        initialisation (kernel selection, thread pools: over 100 ms for the first restore on CPU)."""
        cache = self.worker.new_cache()
        tokens = self.formatter.encode("warm up")
        await self._in_model_thread(self.worker.prefill, cache, tokens)
        blob = serialization.encode(cache.export_layers(), self.worker.fingerprint, tokens)

        def restore_once():
            _, layers = serialization.decode(blob, self.worker.fingerprint, tokens)
            KVCache.from_layers(layers, self.worker.device)

        await asyncio.gather(*(self._in_io_thread(restore_once) for _ in range(self._io_threads._max_workers)))

    async def stop(self) -> None:
        """Graceful shutdown: active KV goes to storage so a restart restores instead of recomputing."""
        if self._sweeper:
            self._sweeper.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for live in list(self._live.values()):
            await self._offload(live)
        self.close()

    def close(self) -> None:
        self._model_thread.shutdown(wait=True)
        self._io_threads.shutdown(wait=True)
        self.history.close()
        self.tiers.close()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_seconds)
            try:
                await self.sweep()
            except Exception:
                log.exception("sweep failed")

    async def sweep(self) -> None:
        """Offloads idle sessions, then least recently used ones while the active pool is over budget."""
        now = time.monotonic()
        for live in list(self._live.values()):
            if live.cache is not None and not live.in_turn and now - live.last_used >= self.config.idle_offload_seconds:
                await self._offload(live)
        await self._enforce_budget()

    async def _enforce_budget(self) -> None:
        active = sorted((s for s in self._live.values() if s.cache is not None), key=lambda s: s.last_used)
        used = sum(s.cache.allocated_bytes for s in active)
        for live in active:
            if used <= self.config.active_kv_budget_bytes:
                break
            if not live.in_turn and live.cache is not None:
                used -= live.cache.allocated_bytes
                await self._offload(live)

    async def _in_model_thread(self, fn, *args, background: bool = False):
        submit = self._model_thread.submit_background if background else self._model_thread.submit
        future = asyncio.wrap_future(submit(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            # A cancelled turn must not roll back the KV while a forward is still writing into it.
            with contextlib.suppress(Exception):
                await future
            raise

    async def _in_io_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io_threads, fn, *args)

    # -- sessions ----------------------------------------------------------------------------------

    async def create(self, system: str | None, metadata: dict | None, compression: dict | None = None) -> Conversation:
        if compression:
            self.compression_of(compression)  # validates
        conversation = Conversation(id=secrets.token_urlsafe(24), created_at=_now(), system=system, metadata=metadata,
                                    compression=compression or None)
        await self._in_io_thread(self.history.save, conversation)
        self._live[conversation.id] = LiveSession(conversation)
        return conversation

    async def _get_live(self, session_id: str) -> LiveSession:
        live = self._live.get(session_id)
        if live is None:
            conversation = await self._in_io_thread(self.history.load, session_id)
            if conversation is None:
                raise SessionNotFound(f"session {session_id} not found")
            live = self._live.setdefault(session_id, LiveSession(conversation))
        return live

    def compression_of(self, overrides: dict | None) -> CompressionConfig:
        base = dataclasses.asdict(self.config.compression)
        try:
            return CompressionConfig(**(base | (overrides or {})))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid compression options: {exc}") from None

    async def view(self, session_id: str) -> SessionView:
        live = await self._get_live(session_id)
        is_active = live.cache is not None
        compression = self.compression_of(live.conversation.compression)
        tier = None if is_active else self.tiers.locate(live.id)
        tier_codec = self.tier_codecs.get(tier, "none")
        return SessionView(
            id=live.id,
            state="active" if is_active else "inactive",
            tier=tier,
            turns=live.conversation.turns,
            tokens=len(live.conversation.tokens),
            stored_bytes=None if is_active else self.tiers.stored_bytes(live.id),
            compression=compression.policy,
            codec=effective_codec(compression.codec, tier_codec),  # what the stored blob holds now
        )

    async def messages(self, session_id: str) -> list[dict]:
        """Reading a conversation (a client opening it) is the cue that a turn may follow: an inactive
        session's KV is promoted toward the worker in the background."""
        live = await self._get_live(session_id)
        if live.cache is None and self.tiers.locate(session_id) not in (None, self.tiers.tiers[0].name):
            self._background(self._in_io_thread(self.tiers.promote, session_id))
        return list(live.conversation.messages)

    def _background(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def delete(self, session_id: str) -> None:
        live = await self._get_live(session_id)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        async with live.lock:
            self._live.pop(session_id, None)
            live.cache = None
            await self._in_io_thread(self.tiers.delete, session_id)
            await self._in_io_thread(self.history.delete, session_id)

    async def offload(self, session_id: str) -> SessionView:
        live = await self._get_live(session_id)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        await self._offload(live)
        return await self.view(session_id)

    async def _offload(self, live: LiveSession) -> None:
        async with live.lock:
            cache = live.cache
            if cache is None:
                return
            if cache.num_tokens > 0:
                await self._score_for_compression(live, cache)
                tier = await self._in_io_thread(self._store_kv, live, cache)
                log.info("session %s offloaded (%d tokens) to %s", live.id, cache.num_tokens, tier or "nowhere")
            live.cache = None
            live.stats = None

    def head_profile(self, scorer: str) -> HeadProfile | None:
        """The calibrated per-head budgets for this model and scorer, loaded once."""
        if scorer not in self._profiles:
            found = None if self.profile_dir is None else load_profile(self.profile_dir, self.worker.fingerprint, scorer)
            self._profiles[scorer] = found
        return self._profiles[scorer]

    def health_notes(self) -> list[str]:
        config = self.config.compression
        if config.policy == "heads" and config.budgets == "calibrated" and self.head_profile(config.scorer) is None:
            return [f"no calibrated per-head profile for {config.scorer} on this model: uniform budgets "
                    "(run `statekeeper calibrate`)"]
        return []

    async def _score_for_compression(self, live: LiveSession, cache: KVCache) -> None:
        """Scores that need the model (KVzip's reconstruction) run on the model thread before storing."""
        config = self.compression_of(live.conversation.compression)
        if config.policy == "heads" and config.scorer == "kvzip" and live.stats is not None:
            collector, chunks = self.worker.reconstruction_plan(cache, live.conversation.tokens)
            try:
                for chunk in chunks:  # one chunk per job: a live turn waits for at most one
                    await self._in_model_thread(self.worker.reconstruction_step, cache, collector, chunk,
                                                background=True)
            finally:
                await self._in_model_thread(cache.truncate, collector.history_tokens)
            live.stats.reconstruction = collector.scores

    def _store_kv(self, live: LiveSession, cache: KVCache) -> str | None:
        layers, tokens = cache.export_layers(), live.conversation.tokens
        config = self.compression_of(live.conversation.compression)
        compressor = compressor_from_config(config, self.head_profile(config.scorer))
        stored, meta = None, {}
        if compressor is not None:
            try:
                compressed = compressor.compress(layers, live.stats, cache.head_bias)
                stored, meta = compressed.tensors or serialization.layer_tensors(layers), compressed.detail
            except ValueError as exc:  # e.g. no statistics since a restart: store it whole this time
                log.info("cannot compress %s: %s", live.id, exc)
        if stored is None:
            if cache.head_bias is not None:
                # Entries this state evicted are hidden only by its bias; stored whole, they would be served.
                log.info("not storing %s: it will be recomputed from its history", live.id)
                return None
            stored = serialization.layer_tensors(layers)
        return self.tiers.put(live.id, serialization.encode_tensors(stored, self.worker.fingerprint, tokens,
                                                                    cache.num_tokens, meta))

    # -- restore -----------------------------------------------------------------------------------

    def _load_kv(self, session_id: str, tokens: list[int]) -> tuple[KVCache | None, str | None, dict | None]:
        """The stored KV if a valid blob exists (and the pipeline's report when part was recomputed); a
        bad blob is counted, discarded and never used."""
        with self.tiers.read(session_id) as (tier, blob):
            if blob is None:
                return None, None, None
            try:
                cache, report = self._import_blob(blob, tokens, tier)
                return cache, tier, report
            except serialization.BlobError as exc:
                log.warning("discarding KV blob of %s from %s: %s", session_id, tier, exc)
                self.tiers.record_error(tier)
            except Exception:  # a blob that passed its checks but still cannot be used: recompute, never fail
                log.exception("discarding unusable KV blob of %s from %s", session_id, tier)
                self.tiers.record_error(tier)
        self.tiers.delete(session_id)
        return None, None, None

    def _import_blob(self, blob, tokens: list[int], tier: str) -> tuple[KVCache | None, dict | None]:
        # Its own frame, so no view into the tier's buffer outlives the read (an mmap cannot close
        # while views into it exist).
        header, tensors = serialization.decode_tensors(blob, self.worker.fingerprint, tokens)
        plan = self._restore_plan(header, tier)
        if plan is not None and plan.recompute_tokens == plan.num_tokens:
            return None, None  # recomputing everything is faster than reading this tier
        if plan is not None and plan.recompute_tokens > 0:
            # Recompute a prefix on the model thread while a loader copies the rest out of the blob;
            # this I/O thread holds the read (and so the blob's views) open until it is done.
            layers = serialization.plain_layers(header, tensors)
            cache, report = self._model_thread.submit(restore_pipelined, self.worker, layers, tokens, plan).result()
            return cache, report.summary()
        layers, bias = restore_state(tensors, header.meta, self.worker.num_layers)
        shape = (self.worker.num_kv_heads, header.num_tokens, self.worker.head_dim)
        if any(tuple(k.shape) != shape or tuple(v.shape) != shape for k, v in layers):
            raise serialization.BlobError("blob layers do not have the model's shape and the blob's token count")
        if bias is not None and any(tuple(b.shape) != shape[:2] for b in bias):
            raise serialization.BlobError("blob attention bias does not fit its layers")
        return KVCache.from_layers(layers, self.worker.device, bias), None

    def _restore_plan(self, header, tier: str) -> RestorePlan | None:
        """Krul §6's split for a plain (uncompressed) blob on this tier, from the hardware profile."""
        if self.hardware is None or header.meta or tier not in self.hardware.tiers or header.num_tokens == 0:
            return None
        if not self.tiers.tier(tier).streams_reads:
            return None  # the blob is already fetched whole: loading the rest is a memory copy
        per_layer = StoredLayer(2 * self.worker.num_kv_heads * self.worker.head_dim * self.worker.dtype.itemsize)
        return plan_restore(header.num_tokens, [per_layer] * self.worker.num_layers, self.hardware.compute,
                            self.hardware.tiers[tier])

    async def _restore(self, live: LiveSession, tokens: list[int]) -> tuple[str, float]:
        """Makes live.cache cover `tokens` (the history before this turn): loaded, recomputed, or both."""
        if live.cache is not None:
            return "active", 0.0
        started = time.perf_counter()
        if live.stats is None and self.compression_of(live.conversation.compression).needs_stats:
            live.stats = self.worker.new_stats()
        cache, source, live.last_pipeline = None, None, None
        if tokens:
            cache, source, live.last_pipeline = await self._in_io_thread(self._load_kv, live.id, tokens)
        if cache is None:
            cache = self.worker.new_cache()
            if tokens:
                await self._in_model_thread(self.worker.prefill, cache, tokens, live.stats)
                source = "recompute"
        # A loaded blob may cover only a prefix (a session that was active when the process died);
        # the turn's prefill computes whatever follows it.
        live.cache = cache
        return source or "active", (time.perf_counter() - started) * 1000

    async def prefetch(self, session_id: str) -> SessionView:
        """Moves an inactive session's KV to the fastest tier with room, ahead of its next turn."""
        live = await self._get_live(session_id)
        if live.cache is None and self.tiers.locate(session_id) is not None:
            await self._in_io_thread(self.tiers.promote, session_id)
        return await self.view(session_id)

    def stats(self) -> dict:
        """The one stats source for the admin API (and later the dashboard and metrics)."""
        active = [s for s in self._live.values() if s.cache is not None]
        return {
            "tiers": self.tiers.stats(),
            "active_sessions": len(active),
            "active_kv_bytes": sum(s.cache.allocated_bytes for s in active),
            "active_kv_budget_bytes": self.config.active_kv_budget_bytes,
            "missing_blobs_at_start": self.tiers.missing_at_start,
        }

    # -- scoring -----------------------------------------------------------------------------------

    def teacher_forced_tokens(self, tokens: list[int], history: list[dict], messages: list[dict]):
        for message in messages:
            self.check_content(message["content"])
        try:
            return self.formatter.append_turns(tokens, history, messages, self.worker.tokenizer.eos_token_id)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    async def score(self, session_id: str, messages: list[dict]) -> ScoreResult:
        """Scores `messages` appended to the session's state with teacher forcing; the session (history
        and KV) is left as it was."""
        live = await self._get_live(session_id)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        conversation = live.conversation
        tokens, spans = self.teacher_forced_tokens(conversation.tokens, conversation.chat_messages(), messages)
        if len(tokens) > self.worker.context_length:
            raise ContextOverflow(f"scoring needs {len(tokens)} tokens, over the context of {self.worker.context_length}")
        live.in_turn = True
        try:
            async with live.lock:
                restore_source, restore_ms = await self._restore(live, conversation.tokens)
                cache = live.cache
                kv_before = cache.num_tokens
                # The token before the first scored one must be fed: if the cache already holds it, its KV
                # row is set aside and put back afterwards, so the session's KV stays bit-identical.
                start = max(0, min(kv_before, len(conversation.tokens) - 1))
                saved = cache.copy_range(start, kv_before)
                try:
                    cache.truncate(start)
                    logprobs, greedy = await self._in_model_thread(self.worker.score, cache, tokens[start:])
                finally:
                    cache.truncate(start)
                    cache.append(saved)
        finally:
            live.in_turn = False
            live.last_used = time.monotonic()
        scores = [
            TokenScore(tokens[i], float(logprobs[i - start - 1]), int(greedy[i - start - 1]))
            for begin, end in spans
            for i in range(begin, end)
        ]
        return ScoreResult(scores, restore_source, restore_ms)

    # -- turns -------------------------------------------------------------------------------------

    def check_content(self, content: str) -> None:
        if len(content) > self.config.max_content_chars:
            raise ContentTooLarge(f"content has {len(content)} characters; the maximum is {self.config.max_content_chars}")

    async def turn(self, session_id: str, request: TurnRequest) -> AsyncIterator[TurnDelta | TurnResult]:
        """Runs one turn; yields text deltas, then the result. The history changes only if it completes."""
        self.check_content(request.content)
        if request.max_tokens > self.config.max_tokens_limit:
            raise ContextOverflow(f"max_tokens is limited to {self.config.max_tokens_limit}")
        live = await self._get_live(session_id)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        live.in_turn = True
        try:
            async with live.lock:
                async for event in self._run_turn(live, request):
                    yield event
        finally:
            live.in_turn = False
            live.last_used = time.monotonic()
            self._background(self._enforce_budget())

    async def _run_turn(self, live: LiveSession, request: TurnRequest) -> AsyncIterator[TurnDelta | TurnResult]:
        started = time.perf_counter()
        conversation = live.conversation
        user_message = {"role": "user", "content": request.content}
        extension = self.formatter.extend(conversation.tokens, conversation.chat_messages() + [user_message])
        prompt = extension.tokens
        if len(prompt) + request.max_tokens > self.worker.context_length:
            raise ContextOverflow(
                f"the conversation would need {len(prompt)} prompt tokens + max_tokens {request.max_tokens}, "
                f"over the model's context of {self.worker.context_length}"
            )
        if not extension.is_append_only:
            log.warning("chat template is not append-only for %s; recomputing from re-tokenized history", live.id)
            live.cache = None
        history = conversation.tokens if extension.is_append_only else []
        restore_source, restore_ms = await self._restore(live, history)
        if not extension.is_append_only:
            restore_source = "recompute"
        cache = live.cache
        kv_before = cache.num_tokens
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None else secrets.randbits(63))
        generated: list[int] = []
        sent = ""
        ttft_ms = 0.0
        try:
            logits = await self._in_model_thread(self.worker.prefill, cache, prompt[kv_before:], live.stats)
            while True:
                token = self.worker.sample(logits, request.temperature, request.top_p, generator)
                generated.append(token)
                if len(generated) == 1:
                    ttft_ms = (time.perf_counter() - started) * 1000
                is_stop = token in self.worker.stop_token_ids
                is_done = is_stop or len(generated) >= request.max_tokens
                # Special tokens other than the final stop stay in the text, so that rendering the reply
                # through the chat template reproduces exactly the tokens the KV was computed from.
                text = self.formatter.decode(generated[:-1] if is_stop else generated)
                is_whole = is_done or not text.endswith("\ufffd")  # hold back half a UTF-8 character
                delta = text[len(sent) :] if is_whole else ""
                if delta or len(generated) == 1:  # the first token always yields: it marks the TTFT
                    yield TurnDelta(delta)
                if is_whole:
                    sent = text
                if is_done:
                    break
                logits = await self._in_model_thread(self.worker.decode, cache, token, live.stats)
            content = sent
            updated = dataclasses.replace(
                conversation,
                messages=conversation.messages + [user_message, {"role": "assistant", "content": content}],
                tokens=prompt + generated,
            )
            await self._in_io_thread(self.history.save, updated)
        except BaseException:
            cache.truncate(kv_before)  # the KV must keep matching the unchanged history
            raise
        live.conversation = updated
        yield TurnResult(
            content=content,
            prompt_tokens=len(prompt),
            completion_tokens=len(generated),
            cached_tokens=kv_before if restore_source != "recompute" else 0,
            restore_source=restore_source,
            restore_ms=restore_ms,
            restore_pipeline=live.last_pipeline if restore_source not in ("active", "recompute") else None,
            ttft_ms=ttft_ms,
            total_ms=(time.perf_counter() - started) * 1000,
        )
