"""Going inactive: the exact state is stored at once (lossless, the cheap path a returning user reads
back at about the speed of a hot session). Compression is a later, separate step that re-encodes the
stored blob in place when the placement policy says so (the value policy, the default: the blobs most worth
it first, not while their user is likely back within minutes unless the fastest tier is nearly full), or with
the lru policy when it has stayed idle `compress_after_seconds`, when it was demoted below the fastest tier,
or when the fastest tier runs out of room. Compressions that need only the stored KV
(the default's among them) run in a child process on another core (sessions/compress_process.py);
the others run on the model thread, only while no turn runs anywhere. A turn for the conversation
cancels it at once; the turn reads the exact blob, which stays until the compressed one replaces it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from statekeeper.compression import from_config as compressor_from_config
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_profile import HeadProfile
from statekeeper.config import CompressionConfig, SessionConfig
from statekeeper.kv_cache import KVCache
from statekeeper.placement.policy import FULL_FRACTION, LruPlacement, ValuePolicy
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.compress_process import (CompressionCancelled, CompressionProcess, ProcessCounters,
                                                     encode_compressed, runs_in_child)
from statekeeper.sessions.exact_copy import copy_key
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.restore import BlobLoader
from statekeeper.sessions.turn_runner import TurnRunner
from statekeeper.worker import ModelWorker
from storage.manager import TierManager

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionAccess:
    """What compressing a stored blob needs of the session service."""

    find: Callable[[str], Awaitable[LiveSession]]  # a conversation of any tenant, loaded if need be
    compression_of: Callable[[dict | None], CompressionConfig]  # its compression, from its overrides
    head_profile: Callable[[str], HeadProfile | None]  # the calibrated per-head budgets for a scorer
    stored_form: Callable[[str], StoredForm | None]  # what the stored blob holds (an I/O thread's call)
    forget: Callable[[LiveSession], Awaitable[None]]  # a conversation another replica deleted meanwhile
    shared_home: Callable[[str], str | None]  # the shared tier its blob stays in, where replicas share it



@dataclass(eq=False)
class PendingCompression:
    session_id: str
    stored_at: float  # time.monotonic() of the exact store
    stats: AttentionStats | None  # what the conversation's turns gathered (scorers other than KVzip need it)
    is_cancelled: bool = False


@dataclass(slots=True)
class CompressionCounters:
    compressed: int = 0
    cancelled: int = 0  # stopped by a turn for the conversation (or its deletion) while under way
    failed: int = 0
    skipped: int = 0  # nothing to compress with (no blob, or no statistics since a restart): kept exact
    declined: int = 0  # the placement policy judged its user unlikely to return: left exact for eviction
    encode_seconds: float = 0.0  # eviction and codec, on an I/O thread (scoring counts as the model thread's)
    # What the compressed blobs took in their tier before and after: the ratio that compression achieves.
    raw_bytes: int = 0
    stored_bytes: int = 0


class Compactor:
    """Compresses stored exact blobs in the background: in the compression process where the session's
    compression runs there, else on the model thread as background jobs of `compress_chunk_tokens`
    tokens, each started only after no turn has run for `compress_quiet_seconds`, so a live step waits
    for at most one such chunk."""

    def __init__(self, worker: ModelWorker, config: SessionConfig, tiers: TierManager, loader: BlobLoader,
                 executors: Executors, stored_forms: BlobMetaCache, replicas: ReplicaSync, turns: TurnRunner,
                 session: SessionAccess, policy: LruPlacement | ValuePolicy):
        """`turns` says when no turn runs (the quiet this waits for); `session` what it needs of the session
        service; `policy` the placement policy, which decides what is compressed and when if it
        `decides_compression` (else the schedule does)."""
        self.worker = worker
        self.config = config
        self.tiers = tiers
        self.loader = loader
        self.executors = executors
        self.stored_forms = stored_forms
        self.replicas = replicas
        self.turns = turns
        self.session = session
        self.policy = policy
        self.pending: dict[str, PendingCompression] = {}
        self.counters = CompressionCounters()
        self._running: PendingCompression | None = None
        self.process = CompressionProcess(worker) if config.compress_process else None

    def schedule(self, session_id: str, stats: AttentionStats | None) -> None:
        self.pending[session_id] = PendingCompression(session_id, time.monotonic(), stats)

    def cancel(self, session_id: str) -> None:
        entry = self.pending.pop(session_id, None)
        if entry is None:
            return
        entry.is_cancelled = True
        if entry is self._running:
            self.counters.cancelled += 1
            if self.process is not None:
                self.process.cancel()

    def close(self) -> None:
        if self.process is not None:
            self.process.close()

    def report(self) -> dict:
        counters = self.process.counters if self.process is not None else ProcessCounters()
        process = {"process_jobs": counters.jobs, "process_cpu_seconds": round(counters.cpu_seconds, 3)}
        return asdict(self.counters) | {"encode_seconds": round(self.counters.encode_seconds, 3),
                                        "queued": len(self.pending), "exact_copies": asdict(self.loader.copies)} | process

    def due(self, now: float) -> list[PendingCompression]:
        tiers = self.tiers
        fastest = tiers.tiers[0]
        is_full = fastest.usage() >= FULL_FRACTION * fastest.capacity()
        if self.policy.decides_compression:
            return self._due_by_policy(is_full)
        after = self.config.compress_after_seconds
        due = [entry for entry in self.pending.values()
               if is_full or now - entry.stored_at >= after or tiers.locate(entry.session_id) != fastest.name]
        return sorted(due, key=lambda entry: entry.stored_at)

    def _due_by_policy(self, is_full: bool) -> list[PendingCompression]:
        """The blobs the policy wants compressed now, most worth it first (all it would ever compress when
        the fastest tier is nearly full); those it never will are dropped from the queue, the rest stay."""
        ranked, fastest = [], self.tiers.tiers[0].name
        for entry in list(self.pending.values()):
            # Pressed only where compressing frees room in the fastest tier.
            pressed = is_full and self.tiers.locate(entry.session_id) == fastest
            decision = self.policy.compress_decision(entry.session_id, pressed=pressed)
            if decision.priority is not None:
                ranked.append((decision.priority, entry))
            elif decision.retry_at is None:
                self.counters.declined += 1
                self._forget(entry)
        return [entry for _, entry in sorted(ranked, key=lambda pair: -pair[0])]

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_seconds)
            await self.compress_due()

    async def compress_due(self) -> None:
        """Compresses every due blob, oldest first; one failure is counted and the rest go on."""
        for entry in self.due(time.monotonic()):
            if entry.is_cancelled:
                continue
            self._running = entry
            self.policy.compressing(entry.session_id)
            try:
                await self._compress(entry)
            except CompressionCancelled:
                pass
            except Exception:
                log.exception("compressing the stored KV of %s failed; it stays exact", entry.session_id)
                self.counters.failed += 1
                self._forget(entry)
            finally:
                self._running = None
                self.policy.compression_ended(entry.session_id)

    def _forget(self, entry: PendingCompression) -> None:
        if self.pending.get(entry.session_id) is entry:
            del self.pending[entry.session_id]

    async def _compress(self, entry: PendingCompression) -> None:
        session, in_io_thread = self.session, self.executors.in_io_thread
        live = await session.find(entry.session_id)
        config = session.compression_of(live.conversation.compression)
        compressor = compressor_from_config(config, session.head_profile(config.scorer))
        tokens = list(live.conversation.tokens)
        form = await in_io_thread(session.stored_form, entry.session_id)  # the header only
        if compressor is None or form is None or form.is_compressed:
            self.counters.skipped += 1
            self._forget(entry)
            return
        if self.process is not None and runs_in_child(config):
            blob, cpu_ms, exact = await self._compressed_in_child(entry, config, tokens)
        else:  # its CPU is spread over the model and I/O threads' jobs: not timed
            blob, cpu_ms, exact = await self._compressed_here(entry, config, compressor, tokens), None, None
        if blob is None:
            self.counters.skipped += 1
            self._forget(entry)
            return
        await self._keep_exact_copy(entry.session_id, exact)
        async with live.lock:  # a turn that starts now waits only for this put
            if entry.is_cancelled or live.cache is not None or await self.replicas.has_moved_on(entry.session_id,
                                                                                                 tokens):
                # Deleted, expired or taken by a turn meanwhile (here, or on another replica, which stored its
                # newer state): the stored state stays, and a copy written after a delete had removed everything
                # would outlive its conversation
                await in_io_thread(self.tiers.delete, copy_key(entry.session_id))
                raise CompressionCancelled
            exact_bytes = self.tiers.stored_bytes(entry.session_id)
            self.policy.stored_form(entry.session_id, True)
            await in_io_thread(self.tiers.put, entry.session_id, blob, session.shared_home(entry.session_id))
            if await self.replicas.is_deleted_elsewhere(entry.session_id):
                self._forget(entry)
                await session.forget(live)
                return
            self.stored_forms.pop(entry.session_id)  # read back from the new blob when asked
            self._forget(entry)
            self.counters.compressed += 1
            compressed_bytes = self.tiers.stored_bytes(entry.session_id)
            if exact_bytes is not None and compressed_bytes is not None:  # else it fell out of the tiers
                self.counters.raw_bytes += exact_bytes
                self.counters.stored_bytes += compressed_bytes
                self.policy.compressed(len(tokens), exact_bytes, compressed_bytes, cpu_ms)
            log.info("session %s: stored KV compressed (%d bytes)", entry.session_id, len(blob))

    async def _keep_exact_copy(self, session_id: str, exact: bytes | None) -> None:
        """With EXACT_COPY_TIER, the exact blob its compressed form is about to replace stays in that tier
        (sessions/exact_copy.py), whatever the compression. `exact`: its bytes where the compression already read
        them (else read here). Before the put, outside the conversation's lock: a turn that stores a newer state
        meanwhile deletes the copy, and one written after that is of fewer tokens, which a restore rejects."""
        tier = self.config.exact_copy_tier
        if tier is None:
            return

        def keep() -> bool:
            blob = exact if exact is not None else self.tiers.read_bytes(session_id)
            return blob is not None and self.tiers.put(copy_key(session_id), blob, tier) is not None

        if await self.executors.in_io_thread(keep):
            self.loader.copies.kept += 1
        else:
            self.loader.copies.not_kept += 1

    async def _compressed_in_child(self, entry: PendingCompression, config, tokens: list[int]
                                   ) -> tuple[bytes | None, float | None, bytes | None]:
        """The blob, the child's CPU ms on it, and the exact blob it was made from. No wait for quiet: the child
        runs on another core, and the model thread does none of it."""
        exact = await self.executors.in_io_thread(self.tiers.read_bytes, entry.session_id)
        if entry.is_cancelled:
            raise CompressionCancelled
        if exact is None:
            return None, None, None
        blob, cpu_seconds = await self.process.compress(exact, tokens, config)
        return blob, 1000 * cpu_seconds, exact

    async def _compressed_here(self, entry: PendingCompression, config, compressor, tokens: list[int]) -> bytes | None:
        """Scoring as background jobs on the model thread, each after a quiet wait; eviction and the codec
        on an I/O thread."""
        await self._wait_for_quiet(entry)
        loaded = await self.executors.in_io_thread(self.loader.load, entry.session_id, tokens, False)
        if loaded is None or loaded.num_tokens == 0 or loaded.form.is_compressed:
            return None
        cache, stats = loaded.cache, entry.stats or self.worker.new_stats()
        if config.policy == "heads" and config.scorer == "kvzip":
            stats.reconstruction = await self._reconstruction_scores(entry, cache, tokens)
        await self._wait_for_quiet(entry)
        # Eviction and the codec need no model: an I/O thread (the other core) runs them, so a turn that
        # arrives meanwhile does not wait behind them on the model thread.
        return await self.executors.in_io_thread(self._encode, compressor, cache, stats, tokens)

    async def _reconstruction_scores(self, entry: PendingCompression, cache: KVCache, tokens: list[int]) -> list:
        """KVzip's scores, a small chunk per background job, checking before each for a turn."""
        worker = self.worker
        collector, chunks = worker.reconstruction_plan(cache, tokens, self.config.compress_chunk_tokens)
        try:
            for chunk in chunks:
                await self._wait_for_quiet(entry)
                await self.executors.in_model_thread(worker.reconstruction_step, cache, collector, chunk,
                                                     background=True)
        finally:
            cache.truncate(collector.history_tokens)  # no model job runs on this private cache now
        return collector.scores

    def _encode(self, compressor, cache: KVCache, stats: AttentionStats, tokens: list[int]) -> bytearray | None:
        started = time.thread_time()
        try:
            return self._encoded(compressor, cache, stats, tokens)
        finally:
            self.counters.encode_seconds += time.thread_time() - started

    def _encoded(self, compressor, cache: KVCache, stats: AttentionStats, tokens: list[int]) -> bytearray | None:
        try:
            return encode_compressed(compressor, cache, stats, self.worker.fingerprint, tokens)
        except ValueError as exc:  # e.g. a scorer whose statistics were lost in a restart
            log.info("cannot compress the stored KV: %s", exc)
            return None

    async def _wait_for_quiet(self, entry: PendingCompression) -> None:
        turns = self.turns
        while True:
            if entry.is_cancelled:
                raise CompressionCancelled
            if turns.in_progress:
                await turns.quiet.wait()
                continue
            remaining = turns.last_turn_ended + self.config.compress_quiet_seconds - time.monotonic()
            if remaining <= 0:
                return
            await asyncio.sleep(remaining)
