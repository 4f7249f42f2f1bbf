"""Where a conversation's KV goes when it leaves memory, and what is known of it there: the exact state
stored in the fastest tier with room (the shared one when replicas share the history), compression scheduled
for later (sessions/offload.py), and each stored blob's meta remembered (sessions/blob_meta.py) so that views
need not read it back."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch

from statekeeper.compression.head_budget import padded_bias
from statekeeper.history import HistoryStore
from statekeeper.kv_cache import KVCache
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


def exact_tensors(cache: KVCache) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """The cache as it is, bit for bit: its K/V rows and, for a state restored from per-head eviction,
    its attention bias (without it the entries that state evicted would be attended again)."""
    tensors = serialization.layer_tensors(cache.export_layers())
    if cache.head_bias is None:
        return tensors, {}
    biases = [padded_bias(bias, cache.num_tokens).contiguous() for bias in cache.head_bias]
    return tensors + [(f"{i}.bias", bias) for i, bias in enumerate(biases)], {"bias": True}


def is_compressed(meta: dict) -> bool:
    return any(meta.get(key) is not None for key in ("quant", "heads", "pairs", "method"))


class Placement:
    def __init__(self, worker: ModelWorker, tiers: TierManager, history: HistoryStore, executors: Executors,
                 stored_forms: BlobMetaCache, replicas: ReplicaSync, is_lossless: Callable[[LiveSession], bool],
                 schedule_compression: Callable, forget: Callable[[LiveSession], Awaitable[None]]):
        """`is_lossless(live)`: whether the conversation's compression keeps its KV exact (then nothing is
        scheduled); `schedule_compression(id, stats)`: the compactor's; `forget(live)`: the session service's,
        for a conversation another replica deleted while this one stored it."""
        self.worker = worker
        self.tiers = tiers
        self.history = history
        self.executors = executors
        self.stored_forms = stored_forms
        self.replicas = replicas
        self._is_lossless = is_lossless
        self._schedule_compression = schedule_compression
        self._forget = forget

    async def store(self, live: LiveSession, tier: str | None = None) -> None:
        """Stores the session's KV (from `tier` down, else in the fastest tier with room) and frees it."""
        async with live.lock:
            cache = live.cache
            if cache is None:
                return
            if cache.num_tokens > 0:
                is_unchanged = live.stored_tokens == cache.num_tokens and self.tiers.locate(live.id) is not None
                tier = self.tiers.locate(live.id) if is_unchanged else await self.executors.in_io_thread(
                    self._store_exact, live, cache, tier or self._shared_tier())
                if not is_unchanged and await self.replicas.is_deleted_elsewhere(live.id):
                    await self._forget(live)
                    return
                log.info("session %s offloaded (%d tokens) to %s%s", live.id, cache.num_tokens, tier or "nowhere",
                         " (blob unchanged)" if is_unchanged else "")
                if tier is not None and not self._is_lossless(live):
                    meta = await self.executors.in_io_thread(self.stored_meta, live.id)
                    if meta is not None and not is_compressed(meta):
                        self._schedule_compression(live.id, live.stats)
            live.cache, live.stats, live.stored_tokens = None, None, None

    def _shared_tier(self) -> str | None:
        """Where going inactive stores the KV when replicas share the history: the tier they share (Redis),
        so whichever replica runs the conversation's next turn restores it instead of recomputing."""
        if not self.history.is_shared:
            return None
        return next((tier.name for tier in self.tiers.tiers if tier.is_shared), None)

    def _store_exact(self, live: LiveSession, cache: KVCache, tier: str | None = None) -> str | None:
        tensors, meta = exact_tensors(cache)
        blob = serialization.encode_tensors(tensors, self.worker.fingerprint, live.conversation.tokens,
                                            cache.num_tokens, meta)
        tier = self.tiers.put(live.id, blob, tier)
        self.stored_forms.pop(live.id)
        if tier is not None and not self.tiers.transcoders.get(tier):
            self.stored_forms.put(live.id, tier, meta)
        return tier

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

