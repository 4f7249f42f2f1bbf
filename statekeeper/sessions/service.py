"""The session service: the one front the API calls for conversations, their lifecycle (active <-> inactive)
and turns. It holds the parts, each with one role, and hands each what it needs:
- executors.py: where work runs (the model lanes, I/O and restore threads);
- registry.py: the conversations in memory, their bounds and the budget sweep;
- placement.py: storing a conversation's KV when it goes inactive, and its blob's meta;
- kv_restore.py: where a turn's KV comes from (a branch, a stored blob, a recompute);
- turn_runner.py: one turn or scoring (its slot, limits, token loop, commit);
- replicas.py: following a history that other replicas share;
- resend.py: which conversation a client that resends its messages continues;
- admin_rows.py: the admin dashboard's conversation table;
- offload.py: compressing stored blobs later.
Active: the KV lives in the worker. Inactive: its exact state was serialized into a storage tier (or
dropped; the history always remains, so the state can be recomputed), and compressed there later."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from scheduler.batch import BatchLimits
from scheduler.lanes import wants_long_lane
from statekeeper.batch_forward import Segment
from statekeeper.chat import ChatFormatter
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.head_profile import HeadProfile, load_profile
from statekeeper.config import CompressionConfig, SessionConfig
from statekeeper.coordination import ConversationLeases
from statekeeper.dashboard import StatsHistory
from statekeeper.history import Conversation, HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.metrics import Metrics
from statekeeper.memory import FreedMemory
from statekeeper.profile import HardwareProfile
from statekeeper.sessions.admin_rows import AdminRows
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.kv_restore import KVRestorer
from statekeeper.sessions.errors import ContextOverflow, InvalidRequest, TurnInProgress, as_refusal
from statekeeper.sessions.live import LiveSession, SessionView, utc_now
from statekeeper.sessions.offload import Compactor, SessionAccess
from statekeeper.sessions.placement import Placement, is_compressed
from statekeeper.sessions.registry import SessionRegistry
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.resend import ResendMatcher
from statekeeper.sessions.restore import BlobLoader
from statekeeper.sessions.tenants import TenantGuard
from statekeeper.sessions.turn_runner import TurnRunner
from statekeeper.tenancy import DEFAULT_TENANT, KeyStore, PostgresKeyStore
from statekeeper.sessions.turns import ScoreResult, TurnDelta, TurnRequest, TurnResult
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ShutdownReport:
    stored: int  # active states stored before the deadline
    cut: int  # not stored by the deadline: recomputed from their history after the restart
    failed: int  # their store failed: recomputed as well
    moved: int = 0  # stored states moved out of the tiers that die with the process (DRAM)


class SessionService:
    def __init__(self, worker: ModelWorker, history: HistoryStore, tiers: TierManager, config: SessionConfig,
                 profile_dir: Path | None = None, hardware: HardwareProfile | None = None,
                 keys: KeyStore | PostgresKeyStore | None = None, leases: ConversationLeases | None = None):
        self.worker = worker
        self.profile_dir = profile_dir
        self._profiles: dict[str, HeadProfile | None] = {}
        self.history = history
        self.keys = keys  # API keys and their tenants (statekeeper.tenancy)
        self.tiers = tiers
        self.config = config
        self.formatter = ChatFormatter(worker.tokenizer)
        # Turns' steps batched on the model lanes, history and tier calls on I/O threads (sessions/executors.py).
        # A step's fixed cost in prefill tokens, as measured on this machine, lets a burst of short prompts
        # share steps (scheduler/batch.py); without a profile each runs a step of its own.
        overhead = hardware.compute.step_overhead_tokens if hardware is not None else 0.0
        limits = BatchLimits(max_sessions=config.batch_max_sessions, prefill_tokens=config.batch_prefill_tokens,
                             chunk_tokens=worker.config.prefill_chunk_tokens, step_overhead_tokens=overhead)
        threads = worker.config.num_threads
        self.executors = Executors(self._run_step, limits, threads,
                                   wants_long_lane(config.long_prefill_lane, worker.device.type, threads))
        self.in_model_thread = self.executors.in_model_thread
        self.in_io_thread = self.executors.in_io_thread
        self.in_restore_thread = self.executors.in_restore_thread
        self.loader = BlobLoader(worker, tiers, self.executors.model_thread, hardware)
        # Replicas sharing the history take turns on a conversation one at a time, and follow each other.
        self.replicas = ReplicaSync(history, leases, self.in_io_thread, self.forget)
        self.tenants = TenantGuard(config.tenant_limits, history, tiers)
        self.metrics = Metrics(self.stats)  # GET /metrics
        self.stats_history = StatsHistory()  # the admin dashboard's charts (GET /v1/admin/history)
        # session id -> (tier, its stored blob's meta) as far as known; a blob that lands in another tier
        # may have been re-encoded there (tier codecs), so the meta counts only for that tier.
        self.stored_forms = BlobMetaCache(config.blob_meta_cache_bytes)
        self.started_at = time.time()
        self.freed_memory = FreedMemory()
        self.placement = Placement(worker, tiers, history, self.executors, self.stored_forms, self.replicas,
                                   lambda live: self.compression_of(live.conversation.compression).is_lossless,
                                   lambda session_id, stats: self.compactor.schedule(session_id, stats), self.forget)
        self.sessions = SessionRegistry(config, history, self.in_io_thread, self.placement.store, self.stored_forms)
        self.resend = ResendMatcher(
            history, self.sessions, self.replicas,
            lambda system, tenant: self.create(system, None, tenant=tenant, found_by_messages=True), self.in_io_thread)
        self.admin_rows = AdminRows(history, self.sessions, tiers, self.placement.stored_meta,
                                    lambda conversation: self.compression_of(conversation.compression).policy,
                                    self.in_io_thread)
        self.restorer = KVRestorer(worker, self.loader, self.executors,
                                   lambda live: self.compression_of(live.conversation.compression).needs_stats,
                                   lambda session_id: self.get_live(session_id, tenant=None))
        self.turn_runner = TurnRunner(worker, self.formatter, config, history, self.executors, self.restorer.restore,
                                      self.tenants, self.replicas, lambda session_id: self.compactor.cancel(session_id),
                                      self._record_turn)
        self.compactor = Compactor(worker, config, tiers, self.loader, self.executors, self.stored_forms, self.replicas,
                                   self.turn_runner, SessionAccess(
                                       lambda session_id: self.get_live(session_id, tenant=None), self.compression_of,
                                       self.head_profile, self.placement.stored_meta, self.forget))
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

        executors = self.executors
        await asyncio.gather(*(self.in_io_thread(restore_once) for _ in range(executors.io._max_workers)),
                             *(self.in_restore_thread(restore_once) for _ in range(executors.restore._max_workers)))

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
        offloads = [asyncio.ensure_future(self.placement.store(live, durable)) for live in self.sessions.active()]
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
        self.executors.close()
        self.history.close()
        self.tiers.close()
        if self.keys is not None:
            self.keys.close()
        if self.replicas.leases is not None:
            self.replicas.leases.close()

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
        """Forgets what other replicas deleted, offloads idle and over-budget KV, lets idle conversations
        beyond the bounds leave memory (sessions/registry.py), and gives freed memory back once quiet."""
        await self.replicas.forget_deleted(list(self.sessions))
        await self.sessions.sweep()
        await self._give_back_memory()

    async def _give_back_memory(self) -> None:
        """Once no turn has run for give_back_memory_after_seconds, the memory the last busy spell left freed
        goes back to the kernel (statekeeper/memory.py): while turns run, it is kept for their KV."""
        quiet_for = time.monotonic() - self.turn_runner.last_turn_ended
        if self.turn_runner.in_progress or quiet_for < self.config.give_back_memory_after_seconds:
            return
        await self.in_io_thread(self.freed_memory.give_back)

    def _record_turn(self, result: TurnResult) -> None:
        self.stats_history.record_turn(result.restore_source, result.ttft_ms)
        self.metrics.record_turn(result)

    def _run_step(self, entries: list[tuple[tuple[KVCache, AttentionStats | None], list[int]]]) -> list[torch.Tensor]:
        """On the model thread: one batched forward over the turns' step jobs (scheduler/batch.py)."""
        return self.worker.step([Segment(cache, tokens, stats) for (cache, stats), tokens in entries])

    async def _write_history(self, fn, *args):
        try:
            return await self.in_io_thread(fn, *args)
        except Exception as exc:
            raise as_refusal(exc)  # noqa: B904 - the refusal carries the cause itself

    # -- sessions ----------------------------------------------------------------------------------

    async def create(self, system: str | None, metadata: dict | None, compression: dict | None = None,
                     tenant: str = DEFAULT_TENANT, found_by_messages: bool = False) -> Conversation:
        if system:
            self.turn_runner.check_content(system)  # a system prompt is no longer than a message may be
        if compression:
            self.compression_of(compression)  # validates
        if self.tenants.limits_holdings:
            await self.in_io_thread(self.tenants.check_new_conversation, tenant)
        conversation = Conversation(id=secrets.token_urlsafe(24), created_at=utc_now(), system=system,
                                    metadata=metadata, compression=compression or None, tenant=tenant,
                                    found_by_messages=found_by_messages)
        await self._write_history(self.history.save, conversation)
        self.sessions.add(conversation)
        return conversation

    async def get_live(self, session_id: str, tenant: str | None = DEFAULT_TENANT) -> LiveSession:
        """The session, loaded from the history if need be (SessionRegistry.get: another tenant's is not found;
        `tenant=None` is the service's own access)."""
        return await self.sessions.get(session_id, tenant)

    def compression_of(self, overrides: dict | None) -> CompressionConfig:
        base = dataclasses.asdict(self.config.compression)
        try:
            return CompressionConfig(**(base | (overrides or {})))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid compression options: {exc}") from None

    async def view(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        await self.replicas.follow(live)
        is_active = live.cache is not None
        tier = None if is_active else self.tiers.locate(live.id)
        meta = None if tier is None else await self.in_io_thread(self.placement.stored_meta, live.id)
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

    async def messages(self, session_id: str, tenant: str = DEFAULT_TENANT) -> list[dict]:
        """Reading a conversation (a client opening it) is the cue that a turn may follow: an inactive
        session's KV is promoted toward the worker in the background."""
        live = await self.get_live(session_id, tenant)
        await self.replicas.follow(live)
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
            try:
                # The history first: a replica that writes the KV back checks it afterwards
                # (is_deleted_elsewhere), and what it wrote before that check goes with the blobs below.
                await self._write_history(self.history.delete, session_id)
            except BaseException:
                self.sessions.drop(session_id)  # still in the history: the next request loads it afresh
                raise
            await self.forget(live)
            await self.replicas.forget_lease(session_id)

    async def forget(self, live: LiveSession) -> None:
        """Drops every trace of a conversation deleted here or by another replica: its KV in memory, its
        pending compression, its blob in every tier (one written after the delete included) and its place
        among the sessions."""
        live.deleted = True
        self.compactor.cancel(live.id)  # again, for a delete: an offload that held the lock may have queued it
        self.stored_forms.pop(live.id)
        live.cache, live.stats, live.stored_tokens = None, None, None
        try:
            await self.in_io_thread(self.tiers.delete, live.id)
        finally:
            self.sessions.drop(live.id)

    async def offload(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        await self.replicas.follow(live)
        await self.placement.store(live)
        return await self.view(session_id, tenant)

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
        return self.sessions.held(session_id)

    def health_notes(self) -> list[str]:
        config = self.config.compression
        if config.policy == "heads" and config.budgets == "calibrated" and self.head_profile(config.scorer) is None:
            return [f"no calibrated per-head profile for {config.scorer} on this model: uniform budgets "
                    "(run `statekeeper calibrate`)"]
        return []

    async def compress_due(self) -> None:
        """Compresses the stored blobs that are due now (the background loop calls this every sweep)."""
        await self.compactor.compress_due()

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
        """The admin dashboard's table: a page of every tenant's conversations (sessions/admin_rows.py)."""
        return await self.admin_rows.page(prefix, after, limit)

    def tier_codecs(self) -> dict[str, str]:
        """Each tier's codec (what a blob is re-encoded to when it lands there; "none": kept as written)."""
        return {tier.name: getattr(self.tiers.transcoders.get(tier.name), "codec", "none") for tier in self.tiers.tiers}

    def stats(self) -> dict:
        """The one stats source for the admin API, /metrics (statekeeper/metrics.py) and the dashboard.
        Read it on the event loop's thread: it walks the sessions that the loop changes."""
        sessions = self.sessions.report()
        return self.executors.stats() | {
            "tiers": self.tiers.stats(),
            "sessions_in_memory": sessions["sessions_in_memory"],
            "active_sessions": sessions["active_sessions"],
            "active_kv_bytes": sessions["active_kv_bytes"],
            "active_kv_budget_bytes": self.config.active_kv_budget_bytes,
            "turns_in_progress": self.turn_runner.in_progress,
            "missing_blobs_at_start": self.tiers.missing_at_start,
            "compression": self.compactor.report(),
            # What the service holds that grows with the history rather than the load, against its bounds.
            "memory": {"idle_sessions": sessions["idle_sessions"], "blob_meta": self.stored_forms.report(),
                       "freed_given_back_bytes": self.freed_memory.given_back_bytes},
        }

    # -- turns and scoring -------------------------------------------------------------------------

    async def score(self, session_id: str, messages: list[dict], tenant: str = DEFAULT_TENANT) -> ScoreResult:
        """Scores `messages` appended to the session's state with teacher forcing; the session (history
        and KV) is left as it was."""
        return await self.turn_runner.score(await self.get_live(session_id, tenant), messages)

    async def turn(self, session_id: str, request: TurnRequest, tenant: str = DEFAULT_TENANT
                   ) -> AsyncIterator[TurnDelta | TurnResult]:
        """Runs one turn; yields text deltas, then the result. The history changes only if it completes."""
        runner = self.turn_runner
        new_texts = [request.content, *(message["content"] for message in request.preceding)]
        for content in new_texts:
            runner.check_content(content)
        if request.max_tokens is not None and request.max_tokens > self.config.max_tokens_limit:
            raise ContextOverflow(f"max_tokens is limited to {self.config.max_tokens_limit}")
        live = await self.get_live(session_id, tenant)
        runner.check_room(len(live.conversation.tokens), new_texts, request.max_tokens or 1)
        try:
            # Closed with this generator (a client that leaves closes it between two events): the turn's
            # own cleanup, which truncates the KV back to the history, runs now and not whenever the
            # garbage collector finalizes it, while the session is still held.
            async with runner.slot(live), contextlib.aclosing(runner.run(live, request)) as events:
                async for event in events:
                    yield event
        finally:
            self._background(self.sessions.enforce_budget())

    async def chat(self, messages: list[dict], request: TurnRequest, tenant: str = DEFAULT_TENANT,
                   hint: str | None = None) -> tuple[str, TurnDelta | TurnResult, AsyncIterator[TurnDelta | TurnResult]]:
        """A turn for a client that resends the whole conversation: `request` without its content, which
        is the last message's. Returns the conversation's id, the turn's first event and the rest of them.
        A conversation created here whose turn is refused is deleted again."""
        retried = False
        while True:
            session_id, new, is_new = await self.resend.resume_point(messages, tenant, hint)
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

