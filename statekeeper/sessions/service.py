"""Session service: conversations, their lifecycle (active <-> inactive) and turns.

Active: the KV lives in the worker. Inactive: its exact state was serialized into a storage tier (or
dropped; the history in LMDB always remains, so the state can be recomputed), and compressed there
later (sessions/offload.py). Model calls run on one model thread, one forward at a time; turns of
different sessions interleave step by step in arrival order (fair)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import torch

from scheduler.batch import BatchLimits
from scheduler.lanes import ModelLanes, wants_long_lane
from statekeeper.batch_forward import Segment
from statekeeper.chat import ChatFormatter
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.head_profile import HeadProfile, load_profile
from statekeeper.config import CompressionConfig, SessionConfig
from statekeeper.coordination import ConversationLeases, CoordinationUnavailable
from statekeeper.dashboard import StatsHistory
from statekeeper.history import Conversation, HistoryConflict, HistoryStore, HistoryUnavailable, is_out_of_space
from statekeeper.kv_cache import KVCache
from statekeeper.metrics import Metrics
from statekeeper.memory import FreedMemory
from statekeeper.profile import HardwareProfile
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.errors import (ContentTooLarge, ContextOverflow, ConversationBusy, HistoryDown, InvalidRequest,
                                         Overloaded, SessionNotFound, StorageFull, TurnInProgress)
from statekeeper.sessions.live import LiveSession, SessionView
from statekeeper.sessions.offload import Compactor, exact_tensors, is_compressed
from statekeeper.sessions.restore import BlobLoader
from statekeeper.sessions.tenants import TenantGuard
from statekeeper.tenancy import DEFAULT_TENANT, KeyStore, PostgresKeyStore
from statekeeper.threads import use_threads
from statekeeper.sessions.turns import Generation, ScoreResult, TokenScore, TurnDelta, TurnRequest, TurnResult, generate
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


def as_refusal(exc: BaseException) -> BaseException:
    """A history write that failed for room becomes a 507 (nothing was written: the store aborted the
    transaction), one refused by the turn's compare-and-set a 409, an unreachable store a 503; not a 500."""
    if is_out_of_space(exc):
        refusal = StorageFull("the conversation store is out of space: nothing was saved, try again later")
    elif isinstance(exc, HistoryConflict):
        refusal = ConversationBusy(f"{exc}; nothing was saved, try again")
    elif isinstance(exc, HistoryUnavailable):
        refusal = HistoryDown("the conversation store cannot be reached now: nothing was saved, try again later")
    else:
        return exc
    refusal.__cause__ = exc
    return refusal


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownReport:
    stored: int  # active states stored before the deadline
    cut: int  # not stored by the deadline: recomputed from their history after the restart
    failed: int  # their store failed: recomputed as well
    moved: int = 0  # stored states moved out of the tiers that die with the process (DRAM)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _timestamp(iso: str | None) -> float | None:
    try:
        return datetime.fromisoformat(iso).timestamp() if iso else None
    except ValueError:  # a record written by hand or by an older version
        return None


SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what secrets.token_urlsafe gives, and the API admits

# A shorter common prefix is not worth a copy or a read of another conversation's state.
MIN_BRANCH_TOKENS = 16


def _prefix_copy(cache: KVCache, num_tokens: int, device: torch.device) -> KVCache:
    bias = None if cache.head_bias is None else [bias[:, :num_tokens].clone() for bias in cache.head_bias]
    layers = [(keys[0], values[0]) for keys, values in cache.copy_range(0, num_tokens)]  # without the batch axis
    return KVCache.from_layers(layers, device, bias)


class SessionService:
    def __init__(self, worker: ModelWorker, history: HistoryStore, tiers: TierManager, config: SessionConfig,
                 profile_dir: Path | None = None, hardware: HardwareProfile | None = None,
                 keys: KeyStore | PostgresKeyStore | None = None, leases: ConversationLeases | None = None):
        self.worker = worker
        self.leases = leases  # replicas sharing the history take turns on a conversation one at a time
        self.profile_dir = profile_dir
        self._profiles: dict[str, HeadProfile | None] = {}
        self.history = history
        self.keys = keys  # API keys and their tenants (statekeeper.tenancy)
        self.tiers = tiers
        self.config = config
        self.formatter = ChatFormatter(worker.tokenizer)
        self._live: OrderedDict[str, LiveSession] = OrderedDict()  # least recently used first
        # Turns' steps batched, other live work between steps, background compression work last.
        # TORCH_THREADS is the model thread's alone (statekeeper/threads.py): every other thread runs torch
        # with one, threads born later too.
        # Prompts longer than a chunk may run on a second model thread (scheduler/lanes.py).
        self._lanes = ModelLanes(self._run_step, BatchLimits(
            max_sessions=config.batch_max_sessions, prefill_tokens=config.batch_prefill_tokens,
            chunk_tokens=worker.config.prefill_chunk_tokens), partial(use_threads, worker.config.num_threads),
            wants_long_lane(config.long_prefill_lane, worker.device.type, worker.config.num_threads))
        self._model_thread = self._lanes.main
        use_threads(1)
        self._io_threads = ThreadPoolExecutor(2, thread_name_prefix="statekeeper-io", initializer=use_threads,
                                              initargs=(1,))
        # A returning user's read never queues behind offload writes and compaction on the I/O threads.
        self._restore_threads = ThreadPoolExecutor(2, thread_name_prefix="statekeeper-restore",
                                                   initializer=use_threads, initargs=(1,))
        self.loader = BlobLoader(worker, tiers, self._model_thread, hardware)
        self.compactor = Compactor(self)
        self.tenants = TenantGuard(config.tenant_limits, history, tiers)
        self.metrics = Metrics(self.stats)  # GET /metrics
        self.stats_history = StatsHistory()  # the admin dashboard's charts (GET /v1/admin/history)
        # session id -> (tier, its stored blob's meta) as far as known; a blob that lands in another tier
        # may have been re-encoded there (tier codecs), so the meta counts only for that tier.
        self.stored_forms = BlobMetaCache(config.blob_meta_cache_bytes)
        self.turns_in_progress = 0
        self.started_at = time.time()
        self.last_turn_ended = 0.0  # time.monotonic()
        self.freed_memory = FreedMemory()
        self.quiet = asyncio.Event()  # set while no turn runs (background compression waits for it)
        self.quiet.set()
        self._background_tasks: list[asyncio.Task] = []
        self._tasks: set[asyncio.Future] = set()
        for session_id in self._reconcile_tiers():  # blobs stored exact before a restart get compressed too
            self.compactor.schedule(session_id, None)

    @property
    def model_id(self) -> str:
        """The name clients ask for this model by (OpenAI's `model`): the bundled model's, or its directory's."""
        return Path(self.worker.config.model).name

    @property
    def hardware(self) -> HardwareProfile | None:
        """The profile restores are planned with (None loads every stored token)."""
        return self.loader.hardware

    @hardware.setter
    def hardware(self, profile: HardwareProfile | None) -> None:
        self.loader.hardware = profile

    # -- lifecycle ---------------------------------------------------------------------------------

    def _reconcile_tiers(self) -> set[str]:
        """Blobs whose conversation no longer exists (deleted while the process died) are orphans. A
        shared tier's unknown keys may belong to another replica and are left alone. Returns the
        sessions with a stored blob."""
        known = set(self.history.ids())
        for key in self.tiers.private_keys() - known:
            log.info("removing orphan KV blob %s", key)
            self.tiers.delete(key)
        return self.tiers.keys() & known

    async def start(self) -> None:
        await self.warm_up()
        self._background_tasks = [asyncio.create_task(self._sweep_forever()),
                                  asyncio.create_task(self.compactor.run_forever()),
                                  asyncio.create_task(self._sample_forever())]

    async def warm_up(self) -> None:
        """Runs the restore path once on every thread, so the first user does not pay for lazy
        initialisation (kernel selection, thread pools: over 100 ms for the first restore on CPU)."""
        cache = self.worker.new_cache()
        tokens = self.formatter.encode("warm up")
        await self.in_model_thread(self.worker.prefill, cache, tokens)
        blob = serialization.encode(cache.export_layers(), self.worker.fingerprint, tokens)

        def restore_once():
            _, layers = serialization.decode(blob, self.worker.fingerprint, tokens)
            KVCache.from_layers(layers, self.worker.device)

        await asyncio.gather(*(self.in_io_thread(restore_once) for _ in range(self._io_threads._max_workers)),
                             *(self.in_restore_thread(restore_once) for _ in range(self._restore_threads._max_workers)))

    async def stop(self, deadline_s: float | None = None) -> ShutdownReport:
        """Graceful shutdown within `deadline_s` (default `shutdown_seconds`): active KV goes to storage,
        exact and uncompressed (no scoring), every session at once on the I/O threads, into the first tier
        that outlives the process, then what DRAM holds moves down there too, so a restart restores instead
        of recomputing. What is not stored by the deadline is cut: its history is safe and its next turn
        recomputes. Writes already under way finish before the stores close."""
        deadline_s = self.config.shutdown_seconds if deadline_s is None else deadline_s
        deadline = time.monotonic() + deadline_s
        for task in self._background_tasks:
            task.cancel()
        await asyncio.gather(*self._background_tasks, *self._tasks, return_exceptions=True)
        durable = self.tiers.durable_tier()
        offloads = [asyncio.ensure_future(self._offload(live, durable)) for live in self._live.values()
                    if live.cache is not None]
        done, cut = await asyncio.wait(offloads, timeout=deadline_s) if offloads else (set(), set())
        for task in cut:
            task.cancel()
        await asyncio.gather(*cut, return_exceptions=True)
        moved = await self.in_io_thread(self.tiers.save_volatile, deadline)
        report = ShutdownReport(stored=sum(1 for task in done if task.exception() is None), cut=len(cut),
                                failed=sum(1 for task in done if task.exception() is not None), moved=moved)
        log.info("shutdown: %d active states stored, %d stored states moved out of memory", report.stored, moved)
        if report.cut or report.failed:
            log.warning("shutdown: %d active states cut by the %.1f s deadline, %d failed; those will be "
                        "recomputed from their history", report.cut, deadline_s, report.failed)
        self.close()
        return report

    def close(self) -> None:
        self.compactor.close()
        self._lanes.shutdown()
        self._io_threads.shutdown(wait=True)
        self._restore_threads.shutdown(wait=True)
        self.history.close()
        self.tiers.close()
        if self.keys is not None:
            self.keys.close()
        if self.leases is not None:
            self.leases.close()

    async def _sample_forever(self) -> None:
        """One sample of the stats for the dashboard's charts every `stats_history.interval_s`. A reachable
        tier that can be pinged (Redis) is pinged first: an outage shows as unavailable within a sample even
        when no request touched the tier (a failed ping marks it down; it reconnects in the background)."""
        while True:
            await asyncio.sleep(self.stats_history.interval_s)
            try:
                await self.in_io_thread(self._ping_tiers)
                self.stats_history.sample(self.stats())
            except Exception:  # a tier that cannot answer now: the next sample tries again
                log.exception("sampling the stats for the dashboard failed")

    def _ping_tiers(self) -> None:
        for tier in self.tiers.tiers:
            if tier.available:
                tier.ping()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_seconds)
            await self.sweep()

    async def sweep(self) -> None:
        """Offloads idle sessions, then least recently used ones while the active pool is over budget.
        One session that fails to offload is logged and dropped from memory; the others go on."""
        now = time.monotonic()
        for live in list(self._live.values()):
            if live.cache is not None and not live.in_turn and now - live.last_used >= self.config.idle_offload_seconds:
                await self._offload_or_drop(live)
        await self._enforce_budget()
        self._forget_idle()
        await self._give_back_memory()

    async def _give_back_memory(self) -> None:
        """Once no turn has run for give_back_memory_after_seconds, the memory the last busy spell left freed
        goes back to the kernel (statekeeper/memory.py): while turns run, it is kept for their KV."""
        quiet_for = time.monotonic() - self.last_turn_ended
        if self.turns_in_progress or quiet_for < self.config.give_back_memory_after_seconds:
            return
        await self.in_io_thread(self.freed_memory.give_back)

    def _forget_idle(self) -> None:
        """Drops the least recently used idle conversations beyond `max_idle_sessions` from memory. Idle:
        no KV in memory, no turn, nobody holding or waiting for its lock, not being deleted; a request
        that already holds the object only reads it (anything that changes a session takes its lock
        first), and the next request loads it again from the history store."""
        idle = [live for live in self._live.values()
                if live.cache is None and not live.in_turn and not live.lock.locked() and not live.deleted]
        held = sum(live.estimated_bytes for live in idle)
        count = len(idle)
        for live in idle:  # least recently used first
            if count <= self.config.max_idle_sessions and held <= self.config.max_idle_bytes:
                break
            del self._live[live.id]
            self.stored_forms.pop(live.id)
            count, held = count - 1, held - live.estimated_bytes

    async def _enforce_budget(self) -> None:
        active = sorted((s for s in self._live.values() if s.cache is not None), key=lambda s: s.last_used)
        used = sum(s.cache.allocated_bytes for s in active)
        for live in active:
            if used <= self.config.active_kv_budget_bytes:
                break
            if not live.in_turn and live.cache is not None:
                used -= live.cache.allocated_bytes
                await self._offload_or_drop(live)

    async def _offload_or_drop(self, live: LiveSession) -> None:
        try:
            await self._offload(live)
        except Exception:
            log.exception("offloading %s failed: its KV is dropped and will be recomputed", live.id)
            live.cache, live.stats = None, None

    async def in_model_thread(self, fn, *args, background: bool = False, waits: list[float] | None = None,
                              tokens: int = 0):
        """`waits`, if given, gets the seconds the job waited in line for the model thread; `tokens`, the
        tokens a live job runs, picks its lane (scheduler/lanes.py)."""
        lane = self._lanes.for_tokens(tokens)
        submit = self._model_thread.submit_background if background else lane.submit
        return await self._finished(submit(fn, *args), waits)

    @staticmethod
    async def _finished(job: Future, waits: list[float] | None, abandon=lambda: None):
        """The result of a model-thread job; `waits`, if given, gets the seconds it waited in line. Cancelled,
        the caller still waits for the job (after `abandon()` asks it to stop early): a cancelled turn must
        not roll back the KV while a forward is still writing into it."""
        future = asyncio.wrap_future(job)
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            abandon()
            with contextlib.suppress(BaseException):  # a job abandoned before it started ends cancelled
                await future
            raise
        if waits is not None:
            waits.append(job.queued_seconds)
        return result

    def _run_step(self, entries: list[tuple[tuple[KVCache, AttentionStats | None], list[int]]]) -> list[torch.Tensor]:
        """On the model thread: one batched forward over the turns' step jobs (scheduler/batch.py)."""
        return self.worker.step([Segment(cache, tokens, stats) for (cache, stats), tokens in entries])

    async def in_step(self, stream, cache: KVCache, tokens: list[int], stats: AttentionStats | None = None,
                      waits: list[float] | None = None) -> torch.Tensor:
        """Appends `tokens` to `cache` in batched steps with other turns'; the logits after the last one.
        `stream` names the turn (None: a one-off job the next step need not wait for); `waits`, if given,
        gets the seconds the job waited in line before its first step."""
        lane = self._lanes.for_tokens(len(tokens))
        job = lane.submit_step(stream, (cache, stats), tokens)
        return await self._finished(job.future, waits, lambda: lane.abandon(job))

    async def in_io_thread(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._io_threads, fn, *args)
        except HistoryUnavailable as exc:  # a read or write of a history database that is down: 503
            raise as_refusal(exc) from exc

    async def in_restore_thread(self, fn, *args):
        """A turn's read of stored KV: threads of its own, so it never waits for background I/O."""
        return await asyncio.get_running_loop().run_in_executor(self._restore_threads, fn, *args)

    async def _write_history(self, fn, *args):
        try:
            return await self.in_io_thread(fn, *args)
        except Exception as exc:
            raise as_refusal(exc)  # noqa: B904 - the refusal carries the cause itself

    # -- sessions ----------------------------------------------------------------------------------

    async def create(self, system: str | None, metadata: dict | None, compression: dict | None = None,
                     tenant: str = DEFAULT_TENANT, found_by_messages: bool = False) -> Conversation:
        if system:
            self.check_content(system)  # a system prompt is no longer than a message may be
        if compression:
            self.compression_of(compression)  # validates
        if self.tenants.limits_holdings:
            await self.in_io_thread(self.tenants.check_new_conversation, tenant)
        conversation = Conversation(id=secrets.token_urlsafe(24), created_at=_now(), system=system, metadata=metadata,
                                    compression=compression or None, tenant=tenant,
                                    found_by_messages=found_by_messages)
        await self._write_history(self.history.save, conversation)
        self._live[conversation.id] = LiveSession(conversation)
        self._forget_idle()
        return conversation

    async def get_live(self, session_id: str, tenant: str | None = DEFAULT_TENANT) -> LiveSession:
        """The session, loaded from the history if it is not in memory. Another tenant's session is not
        found, with the same answer as one that does not exist; `tenant=None` is the service's own access.
        An id that cannot be one (a client's hint: empty, or past what the store can key) is not looked up."""
        if not SESSION_ID.fullmatch(session_id):
            raise SessionNotFound(f"session {session_id[:64]} not found")
        live = self._live.get(session_id)
        if live is None:
            conversation = await self.in_io_thread(self.history.load, session_id)
            if conversation is None:
                raise SessionNotFound(f"session {session_id} not found")
            live = self._live.setdefault(session_id, LiveSession(conversation))
        self._live.move_to_end(session_id)
        if live.deleted or (tenant is not None and live.conversation.tenant != tenant):
            raise SessionNotFound(f"session {session_id} not found")
        return live

    def compression_of(self, overrides: dict | None) -> CompressionConfig:
        base = dataclasses.asdict(self.config.compression)
        try:
            return CompressionConfig(**(base | (overrides or {})))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid compression options: {exc}") from None

    async def view(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        await self._follow_shared_history(live)
        is_active = live.cache is not None
        tier = None if is_active else self.tiers.locate(live.id)
        meta = None if tier is None else await self.in_io_thread(self.stored_meta, live.id)
        quant = (meta or {}).get("quant")
        return SessionView(
            id=live.id,
            state="active" if is_active else "inactive",
            tier=tier,
            turns=live.conversation.turns,
            tokens=len(live.conversation.tokens),
            stored_bytes=None if is_active else self.tiers.stored_bytes(live.id),
            compression=self.compression_of(live.conversation.compression).policy,
            codec=quant["codec"] if quant else "none",  # what the stored blob holds now
            is_compressed=None if meta is None else is_compressed(meta),
        )

    def stored_meta(self, session_id: str) -> dict | None:
        """The stored blob's meta: remembered from the store, else read from the blob's header once."""
        tier, meta = self.stored_forms.get(session_id)
        if tier is None or tier != self.tiers.locate(session_id):
            with self.tiers.read(session_id) as (tier, blob):
                if blob is None:
                    return None
                try:
                    meta = serialization.read_header(blob)[0].meta
                except serialization.BlobError:
                    return {}
            self.stored_forms.put(session_id, tier, meta)
        return meta

    async def messages(self, session_id: str, tenant: str = DEFAULT_TENANT) -> list[dict]:
        """Reading a conversation (a client opening it) is the cue that a turn may follow: an inactive
        session's KV is promoted toward the worker in the background."""
        live = await self.get_live(session_id, tenant)
        await self._follow_shared_history(live)
        if live.cache is None and self.tiers.locate(session_id) not in (None, self.tiers.tiers[0].name):
            self._background(self.in_io_thread(self.tiers.promote, session_id))
        return list(live.conversation.messages)

    def _background(self, awaitable) -> None:
        task = asyncio.ensure_future(awaitable)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def delete(self, session_id: str, tenant: str = DEFAULT_TENANT) -> None:
        live = await self.get_live(session_id, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        self.compactor.cancel(session_id)
        live.deleted = True  # from now on every request for it is a 404, also one already waiting below
        async with live.lock:
            self.compactor.cancel(session_id)  # again: an offload that held the lock may have queued it
            self.stored_forms.pop(session_id)
            live.cache = None
            try:
                # The history first: a replica that writes the KV back checks it afterwards
                # (is_deleted_elsewhere), and what it wrote before that check goes with the blobs below.
                await self._write_history(self.history.delete, session_id)
                await self.in_io_thread(self.tiers.delete, session_id)
                if self.leases is not None:
                    await self.in_io_thread(self.leases.forget, session_id)
            finally:
                self._live.pop(session_id, None)

    async def offload(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        await self._follow_shared_history(live)
        await self._offload(live)
        return await self.view(session_id, tenant)

    async def _offload(self, live: LiveSession, tier: str | None = None) -> None:
        """Stores the session's KV (from `tier` down, else in the fastest tier with room) and frees it."""
        async with live.lock:
            cache = live.cache
            if cache is None:
                return
            if cache.num_tokens > 0:
                is_unchanged = live.stored_tokens == cache.num_tokens and self.tiers.locate(live.id) is not None
                tier = self.tiers.locate(live.id) if is_unchanged else await self.in_io_thread(
                    self._store_exact, live, cache, tier or self._shared_tier())
                if not is_unchanged and await self.is_deleted_elsewhere(live.id):
                    await self.drop_deleted_elsewhere(live)
                    return
                log.info("session %s offloaded (%d tokens) to %s%s", live.id, cache.num_tokens, tier or "nowhere",
                         " (blob unchanged)" if is_unchanged else "")
                if tier is not None and not self.compression_of(live.conversation.compression).is_lossless:
                    meta = await self.in_io_thread(self.stored_meta, live.id)
                    if meta is not None and not is_compressed(meta):
                        self.compactor.schedule(live.id, live.stats)
            live.cache, live.stats, live.stored_tokens = None, None, None

    def _shared_tier(self) -> str | None:
        """Where going inactive stores the KV when replicas share the history: the tier they share (Redis),
        so whichever replica runs the conversation's next turn restores it instead of recomputing."""
        if not self.history.is_shared:
            return None
        return next((tier.name for tier in self.tiers.tiers if tier.is_shared), None)

    def head_profile(self, scorer: str) -> HeadProfile | None:
        """The calibrated per-head budgets for this model and scorer, loaded once found; until then looked
        for again each time, so a profile that `statekeeper calibrate` writes beside a running service is
        used from then on."""
        if self._profiles.get(scorer) is None and self.profile_dir is not None:
            self._profiles[scorer] = load_profile(self.profile_dir, self.worker.fingerprint, scorer)
        return self._profiles.get(scorer)

    def in_memory(self, session_id: str) -> LiveSession | None:
        """The conversation as this service holds it in memory now (its KV, if active), without loading it:
        for inspection (the admin views, tests); None when it is not held."""
        return self._live.get(session_id)

    def health_notes(self) -> list[str]:
        config = self.config.compression
        if config.policy == "heads" and config.budgets == "calibrated" and self.head_profile(config.scorer) is None:
            return [f"no calibrated per-head profile for {config.scorer} on this model: uniform budgets "
                    "(run `statekeeper calibrate`)"]
        return []

    def _store_exact(self, live: LiveSession, cache: KVCache, tier: str | None = None) -> str | None:
        tensors, meta = exact_tensors(cache)
        blob = serialization.encode_tensors(tensors, self.worker.fingerprint, live.conversation.tokens,
                                            cache.num_tokens, meta)
        tier = self.tiers.put(live.id, blob, tier)
        self.stored_forms.pop(live.id)
        if tier is not None and not self.tiers.transcoders.get(tier):
            self.stored_forms.put(live.id, tier, meta)
        return tier

    async def compress_due(self) -> None:
        """Compresses the stored blobs that are due now (the background loop calls this every sweep)."""
        await self.compactor.compress_due()

    # -- restore -----------------------------------------------------------------------------------

    async def _restore(self, live: LiveSession, tokens: list[int], prompt: list[int] | None = None
                       ) -> tuple[str, float, torch.Tensor | None]:
        """Makes live.cache cover `tokens` (the history before this turn): loaded, recomputed, or both.
        With the turn's `prompt`, a compressed blob may be restored together with the prompt's prefill:
        then the cache covers the prompt too and the prefill's logits come back (else None)."""
        if live.cache is not None:
            return "active", 0.0, None
        started = time.perf_counter()
        needs_stats = self.compression_of(live.conversation.compression).needs_stats
        branch_from, live.branch_source = live.branch_source, None
        if not tokens and branch_from is not None and prompt and not needs_stats:
            branched = await self._branch(branch_from, prompt)
            if branched is not None:
                live.cache = branched[0]
                return branched[1], (time.perf_counter() - started) * 1000, None
        if live.stats is None and needs_stats:
            live.stats = self.worker.new_stats()
        loaded = await self.in_restore_thread(self.loader.load, live.id, tokens, True, prompt, live.stats) if tokens else None
        live.last_pipeline = None if loaded is None else loaded.pipeline
        live.last_layerwise = None if loaded is None else loaded.layerwise
        logits = None
        if loaded is not None:
            cache, source, logits, live.stored_tokens = loaded.cache, loaded.tier, loaded.logits, loaded.num_tokens
        else:
            cache, source = self.worker.new_cache(), "active"
            if tokens:
                await self.in_step(None, cache, tokens, live.stats)
                source = "recompute"
        # A loaded blob may cover only a prefix (a session that was active when the process died);
        # the turn's prefill computes whatever follows it.
        live.cache = cache
        return source, (time.perf_counter() - started) * 1000, logits

    async def _branch(self, source_id: str, prompt: list[int]) -> tuple[KVCache, str] | None:
        """The KV that conversation `source_id` holds (active or stored) of the longest token prefix it
        shares with `prompt`, compared token by token, as a cache of its own and where it came from; None
        if there is none worth taking. The source is held meanwhile, so no turn moves its rows; one in a
        turn is not waited for (its turn may be long: this one prefills instead)."""
        try:
            source = await self.get_live(source_id, tenant=None)
        except SessionNotFound:
            return None
        if source.lock.locked():
            return None
        async with source.lock:
            history = source.conversation.tokens
            shared = next((i for i, (a, b) in enumerate(zip(history, prompt)) if a != b), min(len(history), len(prompt)))
            shared = min(shared, len(prompt) - 1)  # the turn prefills at least one token, for its logits
            if shared < MIN_BRANCH_TOKENS or source.deleted:
                return None
            if source.cache is not None:
                return await self.in_io_thread(_prefix_copy, source.cache, shared, self.worker.device), "active"
            loaded = await self.in_restore_thread(self.loader.load, source_id, history, False)
        if loaded is None or loaded.tier == "recompute" or min(shared, loaded.num_tokens) < MIN_BRANCH_TOKENS:
            return None
        loaded.cache.truncate(min(shared, loaded.num_tokens))
        return loaded.cache, loaded.tier

    async def prefetch(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        """Moves an inactive session's KV to the fastest tier with room, ahead of its next turn."""
        live = await self.get_live(session_id, tenant)
        if live.cache is None and self.tiers.locate(session_id) is not None:
            await self.in_io_thread(self.tiers.promote, session_id)
        return await self.view(session_id, tenant)

    async def move(self, session_id: str, tier: str, tenant: str | None = DEFAULT_TENANT) -> SessionView:
        """Moves an inactive session's stored KV to `tier` (or the next slower one with room, as any put);
        the session is held meanwhile, so no turn reads a blob in flight."""
        if tier not in [t.name for t in self.tiers.tiers]:
            raise InvalidRequest(f"no tier {tier!r} here: {', '.join(t.name for t in self.tiers.tiers)}")
        live = await self.get_live(session_id, tenant)
        async with live.lock:
            if live.cache is None and self.tiers.locate(session_id) not in (None, tier):
                await self.in_io_thread(self.tiers.move, session_id, tier)
                self.stored_forms.pop(session_id)  # a tier's codec may have re-encoded it
        return await self.view(session_id, tenant)

    async def conversation_rows(self, prefix: str = "", after: str = "", limit: int = 50) -> list[dict]:
        """The admin dashboard's table: a page of every tenant's conversations by id (HistoryStore.page),
        each as the service knows it now. Listing loads nothing into memory."""
        ids = await self.in_io_thread(self.history.page, prefix, after, limit)
        missing = [session_id for session_id in ids if session_id not in self._live]
        loaded = await self.in_io_thread(lambda: {i: self.history.load(i) for i in missing})
        now_wall, now = time.time(), time.monotonic()
        rows = []
        for session_id in ids:
            live = self._live.get(session_id)
            conversation = live.conversation if live is not None else loaded.get(session_id)
            if conversation is None or (live is not None and live.deleted):
                continue  # deleted meanwhile
            # In memory: its last use; else its last committed turn (or its creation), from the history.
            stored = conversation.updated_at or conversation.created_at
            rows.append({"id": session_id, "conversation": conversation,
                         "is_active": live is not None and live.cache is not None,  # read here, on the loop
                         "last_active": now_wall - (now - live.last_used) if live is not None else
                         _timestamp(stored)})
        return await self.in_io_thread(self._rows, rows)

    def _rows(self, rows: list[dict]) -> list[dict]:
        """The rows' stored forms, read from the tiers on an I/O thread."""
        out = []
        for row in rows:
            session_id, conversation, is_active = row["id"], row["conversation"], row["is_active"]
            tier = None if is_active else self.tiers.locate(session_id)
            try:
                meta = None if tier is None else self.stored_meta(session_id)
            except Exception:  # the tier cannot be read now (Redis down): the row still shows
                meta = None
            quant = (meta or {}).get("quant")
            out.append({
                "id": session_id, "tenant": conversation.tenant, "state": "active" if is_active else "inactive",
                "tier": tier, "turns": conversation.turns, "tokens": len(conversation.tokens),
                "stored_bytes": None if tier is None else self.tiers.stored_bytes(session_id),
                "codec": None if meta is None else (quant["codec"] if quant else "none"),
                "policy": self.compression_of(conversation.compression).policy,
                "created_at": conversation.created_at,
                "last_active": None if row["last_active"] is None else
                datetime.fromtimestamp(row["last_active"], timezone.utc).isoformat(timespec="seconds"),
            })
        return out

    def tier_codecs(self) -> dict[str, str]:
        """Each tier's codec (what a blob is re-encoded to when it lands there; "none": kept as written)."""
        return {tier.name: getattr(self.tiers.transcoders.get(tier.name), "codec", "none") for tier in self.tiers.tiers}

    def stats(self) -> dict:
        """The one stats source for the admin API, /metrics (statekeeper/metrics.py) and the dashboard.
        Read it on the event loop's thread: it walks the sessions that the loop changes."""
        active = [s for s in self._live.values() if s.cache is not None]
        model_thread = self._model_thread
        queued, waited = model_thread.depth(), model_thread.waited()
        return {
            "tiers": self.tiers.stats(),
            "sessions_in_memory": len(self._live),
            "active_sessions": len(active),
            "active_kv_bytes": sum(s.cache.allocated_bytes for s in active),
            "active_kv_budget_bytes": self.config.active_kv_budget_bytes,
            "turns_in_progress": self.turns_in_progress,
            "missing_blobs_at_start": self.tiers.missing_at_start,
            "model_thread": model_thread.busy() | {
                "live_queued": queued["live"], "background_queued": queued["background"],
                "live_wait_seconds": round(waited["live"], 6),
                "background_wait_seconds": round(waited["background"], 6)} | {
                f"batch_{name}": count for name, count in model_thread.batching().items()},
            "long_prefill_lane": None if self._lanes.long is None else self._lanes.long.busy() | {
                "live_queued": self._lanes.long.depth()["live"],
                "live_wait_seconds": round(self._lanes.long.waited()["live"], 6)},
            "compression": self.compactor.report(),
            "memory": self.memory_bounds(),
        }

    def memory_bounds(self) -> dict:
        """What the service holds that grows with the history rather than the load, against its bounds."""
        idle = [live for live in self._live.values() if live.cache is None]
        return {"idle_sessions": {"count": len(idle), "max_count": self.config.max_idle_sessions,
                                  "bytes": sum(live.estimated_bytes for live in idle),
                                  "max_bytes": self.config.max_idle_bytes},
                "blob_meta": self.stored_forms.report(),
                "freed_given_back_bytes": self.freed_memory.given_back_bytes}

    # -- turns and scoring -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _turn_slot(self, live: LiveSession):
        """Marks a turn (or scoring) under way: this conversation's pending compression is cancelled and
        background compression everywhere waits until no turn runs."""
        tenant = live.conversation.tenant
        if self.tenants.limits.stored_bytes:
            await self.in_io_thread(self.tenants.check_stored_bytes, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        if self.turns_in_progress >= self.config.max_concurrent_turns:
            raise Overloaded(f"{self.turns_in_progress} turns are under way, the most this service takes at once")
        with self.tenants.turn(tenant):
            live.in_turn = True
            self.compactor.cancel(live.id)
            self.turns_in_progress += 1
            self.quiet.clear()
            try:
                waiting = time.perf_counter()
                async with live.lock:
                    live.lock_wait_ms = (time.perf_counter() - waiting) * 1000
                    if live.deleted:  # deleted while this request waited for the session
                        raise SessionNotFound(f"session {live.id} not found")
                    async with self._lease(live):
                        if self.history.is_shared:  # another replica may have moved it on
                            await self._refresh_from_history(live)
                        yield
            finally:
                live.in_turn = False
                live.last_used = self.last_turn_ended = time.monotonic()
                self.turns_in_progress -= 1
                if self.turns_in_progress == 0:
                    self.quiet.set()

    async def _commit(self, live: LiveSession, updated: Conversation, kv_before: int) -> None:
        """Saves a finished turn. Once the save has started it commits in its thread whatever happens to
        the caller, so a client that goes away meanwhile (its task cancelled) waits here, still holding the
        session, until it has: memory then follows what was committed, instead of keeping the old history
        that the next turn would save over the committed one."""
        save = asyncio.ensure_future(self.in_io_thread(self.history.commit_turn, updated, live.conversation.turns,
                                                       live.fence))
        cancelled = False
        while not save.done():
            try:
                await asyncio.shield(save)
            except asyncio.CancelledError:
                cancelled = True  # the client left: wait on, the save commits regardless
            except Exception:  # noqa: S110 - the save failed: handled below, once it is done
                pass
        failed = save.cancelled() or save.exception() is not None
        if failed:
            live.cache.truncate(kv_before)  # the history is unchanged: so must the KV be
        else:
            live.conversation = updated
        if not save.cancelled() and isinstance(save.exception(), ConversationBusy):
            await self._refresh_from_history(live)  # another replica moved it on: follow the stored one
        if cancelled or save.cancelled():
            raise asyncio.CancelledError
        if failed:
            raise as_refusal(save.exception())

    @contextlib.asynccontextmanager
    async def _lease(self, live: LiveSession):
        """Holds the conversation's lease across replicas (statekeeper/coordination.py) for a turn, renewed
        while it runs; its fencing token goes with the turn's commit. A lease held elsewhere is waited for
        up to `wait_seconds`, then the turn is refused (409). Without coordination: nothing."""
        leases = self.leases
        if leases is None:
            yield
            return
        deadline = time.monotonic() + leases.wait_seconds
        while (lease := await self._try_lease(live.id)) is None:
            if time.monotonic() >= deadline:
                raise ConversationBusy("a turn on this conversation is under way on another replica: try again")
            await asyncio.sleep(0.02)
        renewing = asyncio.ensure_future(self._renew_forever(lease))
        live.fence = lease.fence
        try:
            yield
        finally:
            live.fence = None
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            await self.in_io_thread(leases.release, lease)

    async def _try_lease(self, session_id: str):
        try:
            return await self.in_io_thread(self.leases.try_acquire, session_id)
        except CoordinationUnavailable as exc:
            raise HistoryDown("the lease store cannot be reached now: no turn can run, try again later") from exc

    async def _renew_forever(self, lease) -> None:
        while True:
            await asyncio.sleep(self.leases.ttl_ms / 3000)
            if not await self.in_io_thread(self.leases.renew, lease):
                # Another replica may hold it now: this turn's commit is checked by its fencing token.
                log.warning("the lease on %s was lost during a turn", lease.conversation_id)
                return

    async def _follow_shared_history(self, live: LiveSession) -> None:
        """A read of a conversation that other replicas may have moved on shows the stored one (a turn
        under way here shows what it started from)."""
        if self.history.is_shared and not live.in_turn:
            async with live.lock:
                await self._refresh_from_history(live)

    async def _refresh_from_history(self, live: LiveSession) -> None:
        """Takes the stored conversation if another replica committed turns that this one has not seen
        (histories shared through PostgreSQL): its KV in memory no longer matches and is dropped. Called
        while holding the session."""
        stored = await self.in_io_thread(self.history.load, live.id)
        if stored is None:  # deleted on another replica: gone here too, now
            await self.drop_deleted_elsewhere(live)
            raise SessionNotFound(f"session {live.id} not found")
        if (stored.tokens, stored.messages) == (live.conversation.tokens, live.conversation.messages):
            return
        live.conversation, live.cache, live.stats, live.stored_tokens = stored, None, None, None

    async def drop_deleted_elsewhere(self, live: LiveSession) -> None:
        """Forgets a conversation that another replica deleted: its KV in memory, and any copy of its blob
        in this replica's tiers and the shared one (one written here after the delete included)."""
        live.deleted = True
        self.compactor.cancel(live.id)
        self.stored_forms.pop(live.id)
        live.cache, live.stats, live.stored_tokens = None, None, None
        try:
            await self.in_io_thread(self.tiers.delete, live.id)
        finally:
            self._live.pop(live.id, None)

    async def is_deleted_elsewhere(self, session_id: str) -> bool:
        """After a write of a shared history's conversation's KV: whether another replica deleted it meanwhile.
        A delete removes the history first and the blobs after, so a blob written before this check is
        removed by that delete, and one written after it is caught here."""
        return self.history.is_shared and not await self.in_io_thread(self.history.exists, session_id)

    def _check_room(self, history_tokens: int, new_texts: list[str], reply_tokens: int) -> None:
        """Refuses new text that cannot fit the context whatever its tokens, before it is rendered and
        tokenized on the event loop (work that grows with what the client sent)."""
        least = history_tokens + self.formatter.min_tokens(new_texts) + reply_tokens
        if least > self.worker.context_length:
            raise ContextOverflow(f"the conversation would need at least {least} tokens, over the model's context "
                                  f"of {self.worker.context_length}")

    def teacher_forced_tokens(self, tokens: list[int], history: list[dict], messages: list[dict]):
        for message in messages:
            self.check_content(message["content"])
        self._check_room(len(tokens), [message["content"] for message in messages], 0)
        try:
            return self.formatter.append_turns(tokens, history, messages, self.worker.tokenizer.eos_token_id)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None

    async def score(self, session_id: str, messages: list[dict], tenant: str = DEFAULT_TENANT) -> ScoreResult:
        """Scores `messages` appended to the session's state with teacher forcing; the session (history
        and KV) is left as it was."""
        live = await self.get_live(session_id, tenant)
        conversation = live.conversation
        tokens, spans = self.teacher_forced_tokens(conversation.tokens, conversation.chat_messages(), messages)
        if len(tokens) > self.worker.context_length:
            raise ContextOverflow(f"scoring needs {len(tokens)} tokens, over the context of {self.worker.context_length}")
        async with self._turn_slot(live):
            restore_source, restore_ms, _ = await self._restore(live, conversation.tokens)
            cache = live.cache
            kv_before = cache.num_tokens
            # The token before the first scored one must be fed: if the cache already holds it, its KV
            # row is set aside and put back afterwards, so the session's KV stays bit-identical.
            start = max(0, min(kv_before, len(conversation.tokens) - 1))
            saved = cache.copy_range(start, kv_before)
            try:
                cache.truncate(start)
                logprobs, greedy = await self.in_model_thread(self.worker.score, cache, tokens[start:],
                                                              tokens=len(tokens) - start)
            finally:
                cache.truncate(start)
                cache.append(saved)
        scores = [
            TokenScore(tokens[i], float(logprobs[i - start - 1]), int(greedy[i - start - 1]))
            for begin, end in spans
            for i in range(begin, end)
        ]
        return ScoreResult(scores, restore_source, restore_ms)

    def check_content(self, content: str) -> None:
        if len(content) > self.config.max_content_chars:
            raise ContentTooLarge(f"content has {len(content)} characters; the maximum is {self.config.max_content_chars}")

    async def turn(self, session_id: str, request: TurnRequest, tenant: str = DEFAULT_TENANT
                   ) -> AsyncIterator[TurnDelta | TurnResult]:
        """Runs one turn; yields text deltas, then the result. The history changes only if it completes."""
        for content in (request.content, *(message["content"] for message in request.preceding)):
            self.check_content(content)
        if request.max_tokens is not None and request.max_tokens > self.config.max_tokens_limit:
            raise ContextOverflow(f"max_tokens is limited to {self.config.max_tokens_limit}")
        live = await self.get_live(session_id, tenant)
        self._check_room(len(live.conversation.tokens),
                         [request.content, *(message["content"] for message in request.preceding)],
                         request.max_tokens or 1)
        try:
            # Closed with this generator (a client that leaves closes it between two events): the turn's
            # own cleanup, which truncates the KV back to the history, runs now and not whenever the
            # garbage collector finalizes it, while the session is still held.
            async with self._turn_slot(live), contextlib.aclosing(self._run_turn(live, request)) as events:
                async for event in events:
                    yield event
        finally:
            self._background(self._enforce_budget())

    async def resume_point(self, messages: list[dict], tenant: str = DEFAULT_TENANT, hint: str | None = None
                           ) -> tuple[str, list[dict], bool]:
        """For a client that resends its whole conversation (`messages`, the new user message last): the
        stored conversation whose history is the longest prefix of `messages` (compared message by
        message), and the messages it does not hold yet; without one, a new conversation (the first
        message its system prompt, if a system message) and every message. The third value says whether
        the conversation is new. `hint` names a conversation to try first, also one of /v1/sessions
        (found by id only). A conversation that is in a turn is passed over: two clients that sent the
        same history at once must not both extend it."""
        history = messages[:-1]
        candidates = await self.in_io_thread(self.history.find_heads, history, tenant)
        if hint is not None:
            candidates.insert(0, (hint, None))
        for session_id, length in candidates:
            try:
                live = await self.get_live(session_id, tenant)
            except SessionNotFound:
                continue
            await self._follow_shared_history(live)  # another replica may have moved it on
            held = live.conversation.chat_messages()
            if not (live.in_turn or live.deleted) and length in (None, len(held)) and history[:len(held)] == held:
                return session_id, messages[len(held):], False
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        conversation = await self.create(system, None, tenant=tenant, found_by_messages=True)
        sources, _ = await self.in_io_thread(self.history.find_branch, history, tenant)
        if sources:  # the client edited or dropped a later turn of another conversation
            self._live[conversation.id].branch_source = sources[0]
        return conversation.id, messages[1:] if system is not None else messages, True

    async def chat(self, messages: list[dict], request: TurnRequest, tenant: str = DEFAULT_TENANT,
                   hint: str | None = None) -> tuple[str, TurnDelta | TurnResult, AsyncIterator[TurnDelta | TurnResult]]:
        """A turn for a client that resends the whole conversation: `request` without its content, which
        is the last message's. Returns the conversation's id, the turn's first event and the rest of them.
        A conversation created here whose turn is refused is deleted again."""
        retried = False
        while True:
            session_id, new, is_new = await self.resume_point(messages, tenant, hint)
            events = self.turn(session_id, dataclasses.replace(request, content=new[-1]["content"],
                                                               preceding=tuple(new[:-1])), tenant)
            try:
                return session_id, await anext(events), events
            except TurnInProgress:
                if retried:
                    raise
                retried = True  # another request took the conversation between the lookup and the turn
            except BaseException:
                if is_new:
                    await self.delete(session_id, tenant)
                raise

    async def _run_turn(self, live: LiveSession, request: TurnRequest) -> AsyncIterator[TurnDelta | TurnResult]:
        started = time.perf_counter()
        conversation = live.conversation
        new_messages = [*request.preceding, {"role": "user", "content": request.content}]
        extension = self.formatter.extend(conversation.tokens, conversation.chat_messages() + new_messages)
        prompt = extension.tokens
        if request.max_tokens is None:  # as many as the context has room for, within the service's limit
            room = max(1, min(self.config.max_tokens_limit, self.worker.context_length - len(prompt)))
            request = dataclasses.replace(request, max_tokens=room)
        if len(prompt) + request.max_tokens > self.worker.context_length:
            raise ContextOverflow(
                f"the conversation would need {len(prompt)} prompt tokens + max_tokens {request.max_tokens}, "
                f"over the model's context of {self.worker.context_length}"
            )
        if not extension.is_append_only:
            log.warning("chat template is not append-only for %s; recomputing from re-tokenized history", live.id)
            live.cache = None
        history = conversation.tokens if extension.is_append_only else []
        restore_source, restore_ms, logits = await self._restore(live, history, prompt)
        if not extension.is_append_only:
            restore_source = "recompute"
        cache = live.cache
        # The KV as it was before this turn: a restore that ran the prompt's prefill already holds more.
        kv_before = live.stored_tokens if logits is not None else cache.num_tokens
        done: list[Generation] = []
        waits: list[float] = []  # each model job's wait in line: the first one's is before the first token

        stream = object()  # this turn, to the batch scheduler

        async def step(tokens: list[int]) -> torch.Tensor:
            return await self.in_step(stream, cache, tokens, live.stats, waits)

        try:
            deltas = generate(self.worker, self.formatter, step, prompt[kv_before:], request, started, done, logits,
                              finished=lambda: self._model_thread.end_stream(stream))
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield delta
        except BaseException:
            cache.truncate(kv_before)  # the KV must keep matching the unchanged history
            raise
        finally:
            self._model_thread.end_stream(stream)
        reply = done[0]
        updated = dataclasses.replace(
            conversation,
            messages=conversation.messages + new_messages + [{"role": "assistant", "content": reply.text}],
            tokens=prompt + reply.tokens,
            updated_at=_now(),
        )
        if cache.num_tokens > len(updated.tokens):  # a reply cut at a stop string keeps fewer tokens
            cache.truncate(len(updated.tokens))
        await self._commit(live, updated, kv_before)
        result = TurnResult(
            content=reply.text,
            prompt_tokens=len(prompt),
            completion_tokens=len(reply.tokens),
            cached_tokens=kv_before if restore_source != "recompute" else 0,
            restore_source=restore_source,
            restore_ms=restore_ms,
            restore_pipeline=live.last_pipeline if restore_source not in ("active", "recompute") else None,
            restore_layerwise=live.last_layerwise if restore_source not in ("active", "recompute") else None,
            ttft_ms=reply.ttft_ms,
            total_ms=(time.perf_counter() - started) * 1000,
            lock_wait_ms=live.lock_wait_ms,
            first_queue_ms=waits[0] * 1000 if waits and logits is None else None,
            finish_reason=reply.finish_reason,
        )
        self.stats_history.record_turn(result.restore_source, result.ttft_ms)
        self.metrics.record_turn(result)  # committed: the turn happened, whether or not its client stays
        yield result
