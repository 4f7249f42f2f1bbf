"""The session service: the one front the API calls for conversations, their lifecycle (active <-> inactive)
and turns. It holds the parts, each with one role, and hands each what it needs:
- executors.py: where work runs (the model lanes, I/O and restore threads);
- registry.py: the conversations in memory, their bounds and the budget sweep;
- placement.py: where a conversation's KV is stored when it goes inactive, moved and viewed;
- compression_choice.py: which compression a conversation's stored KV gets;
- kv_restore.py: where a turn's KV comes from (a branch, a stored blob, a recompute);
- turn_runner.py: one turn or scoring (its slot, limits, token loop, commit);
- replicas.py: following a history that other replicas share;
- resend.py: which conversation a client that resends its messages continues;
- readouts.py: the stats, health and admin views (admin_rows.py: the conversation table);
- records.py: API keys and stored /v1/responses bodies;
- offload.py: compressing stored blobs later;
- placement_feed.py: what each turn tells the placement policy (and TRACE_FILE); retention.py: pin / priority /
  TTL, what applies and its expiry;
- next_turn.py: the next turn's state prepared in background time, for templates that rewrite a turn;
  date_rollover.py: the same at midnight, for templates that write today's date;
- background.py: the sweep, compression and dashboard loops; shutdown.py: a graceful stop.
Active: the KV lives in the worker. Inactive: its exact state was serialized into a storage tier (or
dropped; the history always remains, so the state can be recomputed), and compressed there later."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from scheduler.batch import BatchLimits
from scheduler.lanes import wants_long_lane
from statekeeper.batch_forward import Segment
from statekeeper.chat import ChatFormatter
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.config import SessionConfig
from statekeeper.coordination import ConversationLeases
from statekeeper.history import Conversation, HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.dense_rows_choice import DenseRowsChoice
from statekeeper.kv_dtype_choice import KVDtypeChoice
from statekeeper.metrics import Metrics
from statekeeper.placement.costs import CostProfile
from statekeeper.placement.policy import build_policy
from statekeeper.placement.retention import Retention
from statekeeper.profile import HardwareProfile
from statekeeper.sessions.background import BackgroundWork
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.compression_choice import CompressionChoice
from statekeeper.sessions.errors import TurnInProgress, as_refusal
from statekeeper.sessions.exact_copy import delete_stored
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.kv_restore import KVRestorer
from statekeeper.sessions.live import LiveSession, SessionView, utc_now
from statekeeper.sessions.date_rollover import DateRollover
from statekeeper.sessions.next_turn import NextTurnState
from statekeeper.sessions.offload import Compactor, SessionAccess
from statekeeper.sessions.placement import Placement
from statekeeper.sessions.placement_feed import PlacementFeed
from statekeeper.sessions.readouts import Readouts
from statekeeper.sessions.records import Records
from statekeeper.sessions.registry import SessionRegistry
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.resend import ResendMatcher
from statekeeper.sessions.retention import RetentionControl
from statekeeper import device_profile
from statekeeper.device_restore import DeviceRestorer
from statekeeper.sessions.restore import BlobLoader
from statekeeper.sessions.shutdown import ShutdownReport, store_before_exit
from statekeeper.sessions.tenants import TenantGuard
from statekeeper.sessions.turn_runner import TurnRunner
from statekeeper.sessions.turns import ScoreResult, TurnDelta, TurnRequest, TurnResult
from statekeeper.tenancy import DEFAULT_TENANT, KeyStore, PostgresKeyStore
from statekeeper.worker import ModelWorker
from storage.manager import TierManager

__all__ = ["SessionService", "ShutdownReport"]


class SessionService:
    def __init__(self, worker: ModelWorker, history: HistoryStore, tiers: TierManager, config: SessionConfig,
                 profile_dir: Path | None = None, hardware: HardwareProfile | None = None,
                 keys: KeyStore | PostgresKeyStore | None = None, leases: ConversationLeases | None = None,
                 kv_dtype: KVDtypeChoice | None = None, dense_rows: DenseRowsChoice | None = None):
        self.worker = worker
        self.history = history
        # What KV_DTYPE=auto chose by measurement at start (statekeeper/kv_dtype_choice.py), or the setting's rule.
        self.kv_dtype = kv_dtype or KVDtypeChoice.unmeasured(worker.kv_dtype)
        self.dense_rows = dense_rows  # from how many rows the GEMM takes a product, where measured at start
        self.tiers = tiers
        self.config = config
        self.formatter = ChatFormatter(worker.tokenizer, worker.config.tool_call_format)
        # The template's probes (renderings of made-up conversations) run once, now: not on the event loop at a turn
        self.formatter.moves_earlier_turns, self.formatter.rewrites_history  # noqa: B018
        self.compression = CompressionChoice(config.compression, profile_dir, worker.fingerprint,
                                             (worker.num_layers, worker.num_kv_heads))
        # Turns' steps batched on the model lanes, history and tier calls on I/O threads (sessions/executors.py).
        # A step's fixed cost in prefill tokens, as measured on this machine, lets a burst of short prompts
        # share steps (scheduler/batch.py); without a profile each runs a step of its own.
        overhead = hardware.compute.step_overhead_tokens if hardware is not None else 0.0
        limits = BatchLimits(max_sessions=config.batch_max_sessions, prefill_tokens=config.batch_prefill_tokens,
                             chunk_tokens=worker.config.prefill_chunk_tokens, step_overhead_tokens=overhead)
        threads = worker.config.num_threads
        self.executors = Executors(self._run_step, limits, threads,
                                   wants_long_lane(config.long_prefill_lane, worker.device.type, threads))
        self.in_io_thread = self.executors.in_io_thread
        self.records = Records(keys, history, self.in_io_thread)  # API keys, stored /v1/responses bodies
        # A GPU worker restores through its copy stream and pinned ring (statekeeper/device_restore.py).
        device_restorer = (DeviceRestorer.for_worker(worker, device_profile.measure_at_start(worker))
                           if worker.device.type == "cuda" else None)
        self.loader = BlobLoader(worker, tiers, self.executors.model_thread, hardware, config.exact_copy_tier,
                                 device_restorer)
        # Replicas sharing the history take turns on a conversation one at a time, and follow each other.
        self.replicas = ReplicaSync(history, leases, self.in_io_thread, self.forget, self.executors.in_lease_thread)
        self.tenants = TenantGuard(config.tenant_limits, history, tiers)
        self._creating = threading.Lock()  # a tenant's conversations counted and a new one saved at once
        self.metrics = Metrics(self.stats)  # GET /metrics
        # session id -> (tier, its stored blob's meta) as far as known; a blob that lands in another tier
        # may have been re-encoded there (tier codecs), so the meta counts only for that tier.
        self.stored_forms = BlobMetaCache(config.blob_meta_cache_bytes)
        self.started_at = time.time()
        # Which blob leaves a full tier and which get compressed (statekeeper/placement/), weighing returns by
        # the restore profile measured at start; told of every turn by the feed, which also writes TRACE_FILE.
        costs = CostProfile.of_service(worker.kv_bytes_per_token, hardware.compute if hardware else None,
                                       hardware.tiers if hardware else {})
        self.placement_policy = build_policy(config.placement_policy, costs, [tier.name for tier in tiers.tiers])
        tiers.use_policy(self.placement_policy)
        self.retention = RetentionControl(config.tenant_retention, history, tiers, self.placement_policy,
                                          self.in_io_thread, lambda session_id: self.sessions.held(session_id),
                                          self._forget_stored)
        self.feed = PlacementFeed(self.placement_policy, self.retention_of, config.trace_file)
        self.placement = Placement(worker, tiers, history, self.executors, self.stored_forms, self.replicas,
                                   self.compression, lambda session_id, stats: self.compactor.schedule(session_id, stats),
                                   self.forget, self.placement_policy, config.exact_copy_tier is not None)
        self.sessions = SessionRegistry(config, history, self.in_io_thread, self.placement.store, self.stored_forms,
                                        self.retention_of)
        self.resend = ResendMatcher(
            history, self.sessions, self.replicas,
            lambda system, tenant: self.create(system, None, tenant=tenant, found_by_messages=True), self.in_io_thread,
            self.turn, self.delete)
        self.restorer = KVRestorer(worker, self.loader, self.executors,
                                   lambda live: self.compression.of(live.conversation.compression).needs_stats,
                                   lambda session_id: self.get_live(session_id, tenant=None))
        self.turn_runner = TurnRunner(worker, self.formatter, config, history, self.executors, self.restorer,
                                      self.tenants, self.replicas, lambda session_id: self.compactor.cancel(session_id),
                                      self._record_turn, self.feed,
                                      lambda live: self.next_turn.take_ahead_for_turn(live))
        self.next_turn = NextTurnState(worker, self.formatter, history, self.executors, self.restorer,
                                       lambda session_id: self.compactor.cancel(session_id),
                                       hardware.compute if hardware is not None else None, self.kv_room)
        self.compactor = Compactor(worker, config, tiers, self.loader, self.executors, self.stored_forms, self.replicas,
                                   self.turn_runner, SessionAccess(
                                       lambda session_id: self.get_live(session_id, tenant=None), self.compression.of,
                                       self.compression.head_profile, self.placement.stored_form, self.forget,
                                       self.placement.shared_home),
                                   self.placement_policy)
        # At midnight, for a template that writes today's date: the next turns prepared (sessions/date_rollover.py).
        self.date_rollover = DateRollover(lambda: list(reversed(list(self.sessions))), self.next_turn,
                                          self.placement_policy.return_chance, self.sessions.enforce_budget,
                                          self.executors.background_lanes)
        self.background = BackgroundWork(config, self.sessions, self.replicas, self.turn_runner, self.compactor,
                                         tiers, self.executors, self.stats, self.retention.sweep)
        self.readouts = Readouts(self)
        for session_id in self.placement.reconcile():  # blobs stored exact before a restart get compressed too
            self.compactor.schedule(session_id, None)

    @property
    def model_id(self) -> str:
        """The name clients ask for this model by (OpenAI's `model`): the bundled model's, or its directory's."""
        return Path(self.worker.config.model).name

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.executors.warm_up(self.worker)
        await self.retention.refresh()  # the tenants' retention defaults set at run time
        self.background.start()
        if self.formatter.renders_today:
            self.background.start_loop(self.date_rollover.run_forever())

    async def stop(self, deadline_s: float | None = None) -> ShutdownReport:
        """Graceful shutdown within `deadline_s` (default `shutdown_seconds`): active KV goes to storage
        (sessions/shutdown.py), so a restart restores instead of recomputing; writes under way finish first."""
        deadline = time.monotonic() + (self.config.shutdown_seconds if deadline_s is None else deadline_s)
        await self.background.stop()
        report = await store_before_exit(self.sessions.active(), self.placement, self.tiers, self.in_io_thread,
                                         deadline)
        self.close()
        return report

    def close(self) -> None:
        self.compactor.close()
        self.feed.close()
        self.executors.close()
        self.history.close()
        self.tiers.close()
        self.records.close()
        if self.replicas.leases is not None:
            self.replicas.leases.close()

    async def sweep(self) -> None:
        """What the background loop runs every `sweep_interval_seconds` (sessions/background.py)."""
        await self.background.sweep()

    async def compress_due(self) -> None:
        """Compresses the stored blobs that are due now (the background loop calls this every sweep)."""
        await self.compactor.compress_due()

    def _record_turn(self, result: TurnResult) -> None:
        self.background.stats_history.record_turn(result.restore_source, result.ttft_ms)
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
                     tenant: str = DEFAULT_TENANT, found_by_messages: bool = False,
                     retention: dict | None = None) -> Conversation:
        if system:
            self.turn_runner.check_content(system)  # a system prompt is no longer than a message may be
        if compression:
            self.compression.of(compression)  # validates
        retention = self.retention.checked(retention)
        conversation = Conversation(id=secrets.token_urlsafe(24), created_at=utc_now(), system=system,
                                    metadata=metadata, compression=compression or None, tenant=tenant,
                                    found_by_messages=found_by_messages, retention=retention)
        await self._write_history(self._save_new, conversation)
        self.sessions.add(conversation)
        return conversation

    def _save_new(self, conversation: Conversation) -> None:
        """On an I/O thread: the tenant's holdings counted and the conversation saved as one step, so that
        creates at once each count the others (across replicas too, over a shared history: HistoryStore.save_new)."""
        if not self.tenants.limits_holdings:
            self.history.save(conversation)
            return
        with self._creating:
            self.tenants.save_new_conversation(conversation)

    # -- retention (sessions/retention.py) --------------------------------------------------------

    def retention_of(self, conversation: Conversation) -> Retention:
        """What applies to the conversation: its own settings over its tenant's over every tenant's ("*")."""
        return self.retention.of(conversation)

    async def set_retention(self, session_id: str, settings: dict | None, tenant: str | None = DEFAULT_TENANT
                            ) -> SessionView:
        """Replaces the conversation's own retention settings (None: its tenant's apply); `tenant=None` is
        the admin's access to any tenant's."""
        live = await self.get_live(session_id, tenant)
        await self.retention.replace(live, settings, self.replicas.lease)
        return await self._view(live)

    async def set_tenant_retention(self, tenant: str, settings: dict | None) -> Retention:
        """Replaces a tenant's retention defaults at run time ("*": every tenant's; None: the configured ones
        apply again); what now applies to its conversations that have none of their own."""
        return await self.retention.set_tenant(tenant, settings)

    def _forget_stored(self, session_id: str) -> None:
        self.compactor.cancel(session_id)
        self.stored_forms.pop(session_id)

    async def _view(self, live: LiveSession) -> SessionView:
        view = await self.placement.view(live)
        return dataclasses.replace(view, retention=dataclasses.asdict(self.retention_of(live.conversation)))

    async def get_live(self, session_id: str, tenant: str | None = DEFAULT_TENANT) -> LiveSession:
        """The session, loaded from the history if need be (SessionRegistry.get: another tenant's is not found;
        `tenant=None` is the service's own access)."""
        return await self.sessions.get(session_id, tenant)

    def in_memory(self, session_id: str) -> LiveSession | None:
        """The conversation as this service holds it in memory now (its KV, if active), without loading it:
        for inspection (the admin views, tests); None when it is not held."""
        return self.sessions.held(session_id)

    async def view(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        await self.replicas.follow(live)
        return await self._view(live)

    async def messages(self, session_id: str, tenant: str = DEFAULT_TENANT) -> list[dict]:
        """Reading a conversation (a client opening it) is the cue that a turn may follow: an inactive
        session's KV is promoted toward the worker in the background."""
        live = await self.get_live(session_id, tenant)
        await self.replicas.follow(live)
        if self.placement.is_below_the_fastest_tier(live):
            self.background.spawn(self.in_io_thread(self.tiers.promote, session_id))
        return list(live.conversation.messages)

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
        self.feed.deleted(live.id)
        live.cache, live.stats, live.stored_tokens = None, None, None
        try:
            await self.in_io_thread(delete_stored, self.tiers, live.id)
        finally:
            self.sessions.drop_deleted(live.id)

    # -- where the KV is (sessions/placement.py) ---------------------------------------------------

    async def offload(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        live = await self.get_live(session_id, tenant)
        if live.in_turn:
            raise TurnInProgress("a turn is in progress on this session")
        await self.replicas.follow(live)
        await self.placement.store(live)
        return await self._view(live)

    async def prefetch(self, session_id: str, tenant: str = DEFAULT_TENANT) -> SessionView:
        """Moves an inactive session's KV to the fastest tier with room, ahead of its next turn."""
        live = await self.get_live(session_id, tenant)
        await self.placement.prefetch(live)
        return await self.view(session_id, tenant)

    async def move(self, session_id: str, tier: str, tenant: str | None = DEFAULT_TENANT) -> SessionView:
        """Moves an inactive session's stored KV to `tier` (or the next slower one with room)."""
        self.placement.check_tier(tier)
        live = await self.get_live(session_id, tenant)
        await self.placement.move(live, tier)
        return await self.view(session_id, tenant)

    # -- turns and scoring -------------------------------------------------------------------------

    async def score(self, session_id: str, messages: list[dict], tenant: str = DEFAULT_TENANT) -> ScoreResult:
        """Scores `messages` appended to the session's state with teacher forcing; the session (history
        and KV) is left as it was."""
        return await self.turn_runner.score(await self.get_live(session_id, tenant), messages)

    async def turn(self, session_id: str, request: TurnRequest, tenant: str = DEFAULT_TENANT
                   ) -> AsyncIterator[TurnDelta | TurnResult]:
        """Runs one turn; yields text deltas, then the result. The history changes only if it completes."""
        runner = self.turn_runner
        new_texts = runner.check_request(request)
        live = await self.get_live(session_id, tenant)
        runner.check_room(len(live.conversation.tokens), new_texts, request.max_tokens or 1)
        held = False  # this request ran the turn: a refused one (another turn runs) leaves that turn's work be
        try:
            # Closed with this generator (a client that leaves closes it between two events): the turn's
            # own cleanup, which truncates the KV back to the history, runs now and not whenever the
            # garbage collector finalizes it, while the session is still held.
            async with runner.slot(live), contextlib.aclosing(runner.run(live, request)) as events:
                held, replying = True, False
                async for event in events:
                    if not replying and isinstance(event, TurnDelta):  # the prompt is in the KV
                        replying = True
                        self.next_turn.start_early(live, request.new_messages, request.tools,
                                                   request.template_options)
                    elif isinstance(event, TurnDelta):
                        self.next_turn.reply_grew(live)
                    yield event
        finally:
            if held:  # a template that renders it otherwise next time
                self.background.spawn(self.next_turn.prepare(live))
            self.background.spawn(self.sessions.enforce_budget())

    async def chat(self, messages: list[dict], request: TurnRequest, tenant: str = DEFAULT_TENANT,
                   hint: str | None = None) -> tuple[str, TurnDelta | TurnResult, AsyncIterator[TurnDelta | TurnResult]]:
        """A turn for a client that resends the whole conversation (sessions/resend.py): the conversation's
        id, the turn's first event and the rest of them."""
        return await self.resend.chat(messages, request, tenant, hint)

    # -- what the API reads besides conversations (sessions/readouts.py, sessions/records.py) -------

    def kv_room(self) -> int:
        """The bytes of KV the states prepared for next turns (early heads, states before a midnight) may take
        now: what the active KV budget leaves beside the active conversations."""
        return self.config.active_kv_budget_bytes - self.sessions.active_bytes()

    def stats(self) -> dict:
        """The one stats source for the admin API, /metrics (statekeeper/metrics.py) and the dashboard."""
        return self.readouts.stats()

    def admit_request(self, tenant: str) -> None:
        """Counts a request toward the tenant's requests per minute (TenantLimitReached past them)."""
        self.tenants.admit_request(tenant)
