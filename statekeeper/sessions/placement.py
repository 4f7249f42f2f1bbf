"""Where a conversation's KV goes when it leaves memory, and what is known of it there: the exact state
stored in the fastest tier with room (the shared one when replicas share the history), compression scheduled
for later (sessions/offload.py), and each stored blob's meta remembered (sessions/blob_meta.py) so that views
need not read it back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import torch

from statekeeper.compression.form import StoredForm
from statekeeper.compression.head_budget import padded_bias
from statekeeper.compression.transcode import Transcoder
from statekeeper.history import HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.placement.policy import LruPlacement, ValuePolicy
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.compression_choice import CompressionChoice
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.errors import InvalidRequest, SessionNotFound
from statekeeper.sessions.live import LiveSession, SessionView
from statekeeper.sessions.exact_copy import copy_key, session_of
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


def exact_tensors(cache: KVCache, windows: list[int | None] | None = None
                  ) -> tuple[list[tuple[str, torch.Tensor]], StoredForm]:
    """The cache as it is, bit for bit: its K/V rows and, for a state restored from per-head eviction,
    its attention bias (without it the entries that state evicted would be attended again). A layer with a
    sliding window (`windows`, per layer) keeps only its last window of rows: no later token attends to the
    rows before them."""
    layers = cache.export_layers()
    if cache.head_bias is None:
        starts = [0 if window is None else max(0, cache.num_tokens - window) for window in windows or ()]
        if any(starts):
            kept = [(k[:, start:], v[:, start:]) for (k, v), start in zip(layers, starts)]
            return serialization.layer_tensors(kept), StoredForm(window_starts=tuple(starts))
        return serialization.layer_tensors(layers), StoredForm()
    tensors = serialization.layer_tensors(layers)
    biases = [padded_bias(bias, cache.num_tokens).contiguous() for bias in cache.head_bias]
    return tensors + [(f"{i}.bias", bias) for i, bias in enumerate(biases)], StoredForm(bias=True)


class Placement:
    def __init__(self, worker: ModelWorker, tiers: TierManager, history: HistoryStore, executors: Executors,
                 stored_forms: BlobMetaCache, replicas: ReplicaSync, compression: CompressionChoice,
                 schedule_compression: Callable, forget: Callable[[LiveSession], Awaitable[None]],
                 policy: LruPlacement | ValuePolicy, keeps_copies: bool = False):
        """`schedule_compression(id, stats)`: the compactor's; `forget(live)`: the session service's, for a
        conversation another replica deleted while this one stored it; `policy` the tiers' placement policy,
        told what each put holds; `keeps_copies`: compressions keep exact copies (EXACT_COPY_TIER)."""
        self.worker = worker
        self.tiers = tiers
        self.history = history
        self.executors = executors
        self.stored_forms = stored_forms
        self.replicas = replicas
        self.compression = compression
        self._schedule_compression = schedule_compression
        self._forget = forget
        self.policy = policy
        self.keeps_copies = keeps_copies

    async def store(self, live: LiveSession, tier: str | None = None) -> None:
        """Stores the session's KV (from `tier` down, else in the fastest tier with room) and frees it."""
        async with live.lock:
            cache = live.cache
            if cache is None:
                return
            if cache.num_tokens > 0:
                is_unchanged = live.stored_tokens == cache.num_tokens and self.tiers.locate(live.id) is not None
                if not is_unchanged and await self._has_moved_on(live):
                    # Another replica ran a later turn (its state may be stored, newer than this) or deleted it
                    log.info("session %s moved on elsewhere: its KV here is dropped, not stored", live.id)
                    live.cache, live.stats, live.stored_tokens = None, None, None
                    with contextlib.suppress(SessionNotFound):  # deleted there: forgotten here too
                        await self.replicas.refresh(live)  # takes the stored conversation
                    return
                tier = self.tiers.locate(live.id) if is_unchanged else await self.executors.in_io_thread(
                    self._store_exact, live, cache, tier or self._shared_tier())
                if not is_unchanged and await self.replicas.is_deleted_elsewhere(live.id):
                    await self._forget(live)
                    return
                log.info("session %s offloaded (%d tokens) to %s%s", live.id, cache.num_tokens, tier or "nowhere",
                         " (blob unchanged)" if is_unchanged else "")
                if tier is not None and not self.compression.of(live.conversation.compression).is_lossless:
                    form = await self.executors.in_io_thread(self.stored_form, live.id)
                    if form is not None and not form.is_compressed:
                        self._schedule_compression(live.id, live.stats)
            live.cache, live.stats, live.stored_tokens = None, None, None

    async def _has_moved_on(self, live: LiveSession) -> bool:
        """Whether another replica moved the conversation on (its state stored there may be newer); False where
        the history cannot answer now: the state is stored all the same (a reader checks its tokens' digest),
        and a history outage dropped every idle conversation's KV at each sweep and at shutdown."""
        try:
            return await self.replicas.has_moved_on(live.id, live.conversation.tokens)
        except Exception as exc:  # noqa: BLE001 - HistoryDown, or whatever the database raised
            log.info("could not check whether %s moved on elsewhere (%s): storing its KV", live.id, exc)
            return False

    def _shared_tier(self) -> str | None:
        """Where going inactive stores the KV when replicas share the history: the tier they share (Redis),
        so whichever replica runs the conversation's next turn restores it instead of recomputing."""
        if not self.history.is_shared:
            return None
        return next((tier.name for tier in self.tiers.tiers if tier.is_shared), None)

    def _store_exact(self, live: LiveSession, cache: KVCache, tier: str | None = None) -> str | None:
        tensors, form = exact_tensors(cache, self.worker.sliding_windows)
        blob = serialization.encode_tensors(tensors, self.worker.fingerprint, live.conversation.tokens,
                                            cache.num_tokens, form.to_meta())
        self.policy.stored_form(live.id, False)
        # An exact copy of an earlier state is stale now. Without copies kept, only one held here from an
        # earlier run that kept them: a delete asks every shared tier (Redis: two round trips per offload)
        if self.keeps_copies or self.tiers.locate(copy_key(live.id)) is not None:
            self.tiers.delete(copy_key(live.id))
        landed = self.tiers.put(live.id, blob, tier)
        if landed is None and tier is not None:  # the shared tier is down or full: this replica's tiers then
            landed = self.tiers.put(live.id, blob)
        tier = landed
        self.stored_forms.pop(live.id)
        if tier is not None and not self.tiers.transcoders.get(tier):
            self.stored_forms.put(live.id, tier, form)
        return tier

    def stored_form(self, session_id: str) -> StoredForm | None:
        """What the stored blob holds: remembered from the store, else read from the blob's header once
        (None: nothing stored, or its tier cannot be read now; a header that cannot be read counts as exact, and
        its restore will tell). A look, not a use: the read leaves the tiers' counts, LRU order and places as
        they were (it promoted the blob it read with PROMOTE_ON_READ, and a move down came straight back)."""
        tier, form = self.stored_forms.get(session_id)
        if tier is None or tier != self.tiers.locate(session_id):
            try:
                with self.tiers.peek(session_id) as (tier, blob):
                    if blob is None:
                        return None
                    try:
                        form = StoredForm.from_meta(serialization.read_header(blob)[0].meta)
                    except (serialization.BlobError, ValueError):
                        return StoredForm()
            except Exception as exc:  # the tier cannot be read now (Redis down): the view still shows
                log.info("could not read the stored form of %s: %s", session_id, exc)
                return None
            self.stored_forms.put(session_id, tier, form)
        return form


    def reconcile(self) -> set[str]:
        """At start: blobs whose conversation no longer exists (deleted while the process died), and their
        exact copies, are orphans and go. A shared tier's unknown keys may belong to another replica and are
        left alone. Returns the sessions with a stored blob."""
        known = set(self.history.ids())
        for key in self.tiers.private_keys() - known:
            if session_of(key) in known:  # an exact copy of a conversation's state (sessions/exact_copy.py)
                continue
            log.info("removing orphan KV blob %s", key)
            self.tiers.delete(key)
        return self.tiers.keys() & known

    async def view(self, live: LiveSession) -> SessionView:
        """The conversation and where its KV is: in memory (active), or stored in a tier and in what form."""
        is_active = live.cache is not None
        tier = None if is_active else self.tiers.locate(live.id)
        form = None if tier is None else await self.executors.in_io_thread(self.stored_form, live.id)
        return SessionView(
            id=live.id,
            state="active" if is_active else "inactive",
            tier=tier,
            turns=live.conversation.turns,
            tokens=len(live.conversation.tokens),
            stored_bytes=None if is_active else self.tiers.stored_bytes(live.id),
            compression=self.compression.of(live.conversation.compression).policy,
            codec="none" if form is None else form.codec_name,  # what the stored blob holds now
            is_compressed=None if form is None else form.is_compressed,
        )

    def is_below_the_fastest_tier(self, live: LiveSession) -> bool:
        """Whether a turn would read this inactive conversation's KV from a tier slower than the first (and
        it may move up: not out of the tier replicas share, shared_home)."""
        return (live.cache is None and self.tiers.locate(live.id) not in (None, self.tiers.tiers[0].name)
                and self.shared_home(live.id) is None)

    def shared_home(self, session_id: str) -> str | None:
        """The shared tier (Redis) holding this conversation's KV where replicas share the history: whichever
        replica runs its next turn restores it from there, so a compressed blob stays there and a read does not
        promote it into this replica's own tiers (which deletes it from the shared one). None otherwise."""
        tier = self.tiers.locate(session_id)
        return tier if tier is not None and tier == self._shared_tier() else None

    async def prefetch(self, live: LiveSession) -> None:
        """Moves an inactive conversation's KV to the fastest tier with room, ahead of its next turn; not out of
        the tier replicas share (shared_home), whichever of them runs that turn."""
        if live.cache is None and self.tiers.locate(live.id) is not None and self.shared_home(live.id) is None:
            await self.executors.in_io_thread(self.tiers.promote, live.id)

    async def move(self, live: LiveSession, tier: str) -> None:
        """Moves an inactive conversation's stored KV to `tier` (or the next slower one with room, as any put);
        the conversation is held meanwhile, so no turn reads a blob in flight."""
        self.check_tier(tier)
        async with live.lock:
            if live.cache is None and self.tiers.locate(live.id) not in (None, tier):
                await self.executors.in_io_thread(self.tiers.move, live.id, tier)
                self.stored_forms.pop(live.id)  # a tier's codec may have re-encoded it

    def check_tier(self, tier: str) -> None:
        if tier not in [t.name for t in self.tiers.tiers]:
            raise InvalidRequest(f"no tier {tier!r} here: {', '.join(t.name for t in self.tiers.tiers)}")

    def tier_codecs(self) -> dict[str, str]:
        """Each tier's codec (what a blob is re-encoded to when it lands there; "none": kept as written)."""
        codecs = {name: transcoder.codec for name, transcoder in self.tiers.transcoders.items()
                  if isinstance(transcoder, Transcoder)}  # statekeeper/assembly.py builds the tiers with these
        return {tier.name: codecs.get(tier.name, "none") for tier in self.tiers.tiers}
