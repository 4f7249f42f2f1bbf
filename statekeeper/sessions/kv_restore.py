"""Where a turn's KV comes from when its conversation holds none in memory: a branch of another
conversation's KV that shares the prompt's start (a client that edited or dropped a later turn), the stored
blob (sessions/restore.py's BlobLoader: loaded, partly recomputed, or decoded behind the prompt's prefill),
or a recompute of the history on the model lanes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import torch

from statekeeper.chat import common_prefix_length
from statekeeper.kv_cache import KVCache
from statekeeper.sessions.errors import SessionNotFound
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.live import LiveSession, StoppedPreparation
from statekeeper.sessions.restore import BlobLoader
from statekeeper.worker import ModelWorker

# A shorter common prefix is not worth a copy or a read of another conversation's state.
MIN_BRANCH_TOKENS = 16


class KVRestorer:
    def __init__(self, worker: ModelWorker, loader: BlobLoader, executors: Executors,
                 needs_stats: Callable[[LiveSession], bool], find: Callable[[str], Awaitable[LiveSession]]):
        """`needs_stats(live)`: whether the conversation's compression gathers attention statistics while it
        runs; `find(id)`: a conversation of any tenant, loaded if need be (SessionNotFound if there is none)."""
        self.worker = worker
        self.loader = loader
        self.executors = executors
        self._needs_stats = needs_stats
        self._find = find

    async def restore(self, live: LiveSession, tokens: list[int], prompt: list[int] | None = None
                      ) -> tuple[str, float, torch.Tensor | None]:
        """Makes live.cache cover `tokens` (the history before this turn): loaded, recomputed, or both.
        With the turn's `prompt`, a compressed blob may be restored together with the prompt's prefill:
        then the cache covers the prompt too and the prefill's logits come back (else None)."""
        if live.cache is not None and (live.cache.num_tokens or not tokens):
            return "active", 0.0, None
        live.cache = None  # an emptied cache (a preparation from storage stopped by a turn) holds nothing
        started = time.perf_counter()
        needs_stats = self._needs_stats(live)
        branch_from, live.branch_source = live.branch_source, None
        if not tokens and branch_from is not None and prompt and not needs_stats:
            branched = await self._branch(branch_from, prompt)
            if branched is not None:
                live.cache = branched[0]
                return branched[1], (time.perf_counter() - started) * 1000, None
        if live.stats is None and needs_stats:
            live.stats = self.worker.new_stats()
        loaded = await self.executors.in_restore_thread(self.loader.load, live.id, tokens, True, prompt, live.stats) if tokens else None
        live.last_pipeline = None if loaded is None else loaded.pipeline
        live.last_layerwise = None if loaded is None else loaded.layerwise
        live.last_device = None if loaded is None else loaded.device
        live.last_exact_copy = None if loaded is None else loaded.exact_copy
        logits = None
        if loaded is not None:
            cache, source, logits, live.stored_tokens = loaded.cache, loaded.tier, loaded.logits, loaded.num_tokens
        else:
            cache, source = self.worker.new_cache(), "active"
            if tokens:
                await self.executors.in_step(None, (cache, live.stats), tokens)
                source = "recompute"
        # A loaded blob may cover only a prefix (a session that was active when the process died);
        # the turn's prefill computes whatever follows it.
        live.cache = cache
        return source, (time.perf_counter() - started) * 1000, logits

    def reset_stats(self, live: LiveSession) -> None:
        """Attention statistics start anew where the KV they summed was cut (none where not needed)."""
        live.stats = self.worker.new_stats() if self._needs_stats(live) else None

    async def restore_prefix(self, live: LiveSession, tokens: list[int], keep: int, prompt: list[int] | None = None,
                             stopped: StoppedPreparation | None = None,
                             prepared: tuple[KVCache, list[int]] | None = None) -> tuple[str, float]:
        """For a turn whose prompt keeps only the first `keep` tokens of the history `tokens` (a chat template
        that rewrote an earlier turn): the KV of those, from memory or a stored blob cut there, as a prefix
        cache would reuse them; nothing past them is recomputed (the turn's prefill computes the rest of its
        prompt). `stopped`: a preparation of the next turn's state this turn stopped part way, whose rows follow
        as far as `prompt` matches them. `prepared`: a cache prepared for this rendering before it was due (the
        next date's, NextTurnState.take_ahead_for_turn) and the tokens it holds rows of, taken instead where it
        keeps more of `prompt`. Attention statistics start anew: the rows they summed are gone."""
        started = time.perf_counter()
        self.reset_stats(live)
        live.last_pipeline = live.last_layerwise = live.last_device = live.last_exact_copy = None
        source = "active"
        if live.cache is not None and not live.cache.num_tokens and (stopped is None or stopped.cache is not live.cache):
            live.cache = None  # emptied by a preparation from storage, and not for this turn's rows: the blob may
        if live.cache is None and keep > 0:
            loaded = await self.executors.in_restore_thread(self.loader.load, live.id, tokens, False)
            if loaded is not None:
                live.cache, source = loaded.cache, loaded.tier
        if live.cache is None or keep == 0:
            live.cache, source = self.worker.new_cache(), "recompute"
        live.cache.truncate(min(keep, live.cache.num_tokens))
        rows = None if stopped is None or prompt is None else stopped.rows_for(live.cache, prompt)
        if rows is not None:
            live.cache.append(rows)
        if prepared is not None and prompt is not None:
            cache, held = prepared
            shared = min(common_prefix_length(held, prompt), len(prompt) - 1)  # the turn prefills one at least
            if shared > live.cache.num_tokens:
                cache.truncate(shared)
                live.cache, source = cache, "active"
        if live.cache.num_tokens == 0:  # nothing kept (KVCache.min_cut): the turn computes it all
            source = "recompute"
        live.stored_tokens = None  # the stored blob (if any) no longer matches what memory holds
        return source, (time.perf_counter() - started) * 1000

    async def _branch(self, source_id: str, prompt: list[int]) -> tuple[KVCache, str] | None:
        """The KV that conversation `source_id` holds (active or stored) of the longest token prefix it
        shares with `prompt`, compared token by token, as a cache of its own and where it came from; None
        if there is none worth taking. The source is held meanwhile, so no turn moves its rows; one in a
        turn is not waited for (its turn may be long: this one prefills instead)."""
        try:
            source = await self._find(source_id)
        except SessionNotFound:
            return None
        if source.lock.locked():
            return None
        async with source.lock:
            history = source.conversation.tokens
            shared = common_prefix_length(history, prompt)
            shared = min(shared, len(prompt) - 1)  # the turn prefills at least one token, for its logits
            if shared < MIN_BRANCH_TOKENS or source.deleted:
                return None
            if source.cache is not None:
                if shared < source.cache.min_cut:  # its sliding layers hold only their window of those rows
                    return None
                return await self.executors.in_io_thread(source.cache.prefix_copy, shared, self.worker.device), "active"
            loaded = await self.executors.in_restore_thread(self.loader.load, source_id, history, False)
        if loaded is None or loaded.tier == "recompute" or min(shared, loaded.num_tokens) < MIN_BRANCH_TOKENS:
            return None
        loaded.cache.truncate(min(shared, loaded.num_tokens))
        if loaded.cache.num_tokens < MIN_BRANCH_TOKENS:  # it could not be cut there (KVCache.min_cut)
            return None
        return loaded.cache, loaded.tier

