"""A conversation the service has in hand, and what a client is shown of it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch

from statekeeper.chat import common_prefix_length
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.history import Conversation
from statekeeper.kv_cache import KVCache


def utc_now() -> str:
    """A conversation's timestamps: ISO 8601 in UTC."""
    return datetime.now(timezone.utc).isoformat()


def epoch_seconds(timestamp: str | None) -> float | None:
    """A conversation's timestamp in seconds since the epoch; None for none, or one not in ISO 8601 (a record
    written by hand or by an older version)."""
    try:
        return datetime.fromisoformat(timestamp).timestamp() if timestamp else None
    except ValueError:
        return None


@dataclass(eq=False, slots=True)
class StoppedPreparation:
    """The rows a next-turn preparation (sessions/next_turn.py) computed past `common` before a turn stopped it:
    the KV of `tokens[common:]` in `cache` on top of its first `common` rows, set aside when the cache went back
    to those."""

    cache: KVCache
    common: int
    tokens: list[int]  # the next turn's rendering, as far as the preparation got
    rows: list[tuple[torch.Tensor, torch.Tensor]]  # KVCache.copy_range(common, len(tokens))

    def rows_for(self, cache: KVCache, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The rows to append to `cache` for a turn whose prompt is `prompt` (up to the last token the prompt
        shares with the preparation, leaving the turn at least one token to prefill), or None: `cache` is not
        the one they were computed on, as it was then, or the prompt parts from them at once."""
        if cache is not self.cache or cache.num_tokens != self.common:
            return None
        shared = min(common_prefix_length(self.tokens, prompt), len(prompt) - 1) - self.common
        if shared <= 0:
            return None
        return [(keys[..., :shared, :], values[..., :shared, :]) for keys, values in self.rows]


@dataclass(eq=False)
class LiveSession:
    conversation: Conversation
    cache: KVCache | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_turn: bool = False
    last_used: float = field(default_factory=time.monotonic)  # loaded, or a turn's end here: the idle clocks'
    stats: AttentionStats | None = None  # gathered while the KV is active, for compression after offload
    last_pipeline: dict | None = None  # the last restore's recompute/load report, if it split the work
    last_layerwise: dict | None = None  # the last restore's layer-by-layer timeline, if it decoded that way
    last_device: dict | None = None  # the last restore's report, if a GPU worker's device restorer ran it
    last_exact_copy: str | None = None  # the tier of the exact copy the last restore took
    lock_wait_ms: float = 0.0  # what the last turn waited for the session (another request's hold on it)
    # Tokens of the stored blob this cache was restored from (or last stored as): while the cache still
    # holds exactly that many, going inactive again keeps the blob instead of storing a new one.
    stored_tokens: int | None = None
    # Set when a delete starts; the entry stays in the service's table until the delete is done, so a
    # request meanwhile finds it (and is told the session is gone) instead of reloading the history.
    deleted: bool = False
    # A conversation that branched off another (a client resent that one's history with a later turn
    # edited): its first turn starts from the KV the other holds of their common token prefix.
    branch_source: str | None = None
    # The fencing token of the lease this replica holds on the conversation during a turn (replicas that
    # share a history, statekeeper/coordination.py); None without coordination.
    fence: int | None = None
    # The background re-prefill of the next turn's state while it holds the lock (sessions/next_turn.py): a
    # turn that arrives cancels it, so that the turn never waits behind a background job in line.
    preparing: asyncio.Task | None = None
    # What that re-prefill had computed past the KV the conversation keeps when a turn stopped it, for the turn
    # to keep as far as its prompt matches it (KVRestorer.restore_prefix), instead of computing it again.
    stopped_preparation: StoppedPreparation | None = None
    # The tokens the turn under way (or the last one) generated, as they are sampled: the next turn's head,
    # prepared meanwhile for a template that moves earlier turns, follows them (NextTurnState.start_early).
    reply: list[int] = field(default_factory=list)
    # That turn's prompt as the ids its KV rows hold (earlier replies keep the tokens the model sampled, which a
    # rendering of their text need not tokenize alike): an early head copies rows only where it agrees with them.
    prompt: list[int] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.conversation.id

    # (conversation, its estimated bytes): a conversation is replaced, never changed in place, so the
    # estimate is made once per conversation, not on every create, sweep and stats call
    _sized: tuple | None = field(default=None, init=False, repr=False)

    @property
    def estimated_bytes(self) -> int:
        """What the conversation object holds in memory, about (without its KV): a token id in a list is
        an 8-byte slot and a 28-byte int (ids past 256 are not shared), the text a byte a character plus a
        str's header per message, the metadata as its JSON."""
        conversation = self.conversation
        if self._sized is None or self._sized[0] is not conversation:
            text = sum(len(message["content"]) + 100 for message in conversation.messages)
            self._sized = (conversation, 1024 + 36 * len(conversation.tokens) + text + len(conversation.system or "")
                           + len(json.dumps(conversation.metadata or {})))
        return self._sized[1]


@dataclass(slots=True)
class SessionView:
    id: str
    state: str
    tier: str | None
    turns: int
    tokens: int
    stored_bytes: int | None
    compression: str  # the session's policy
    codec: str  # what the stored blob holds now
    is_compressed: bool | None  # whether the stored blob is compressed yet (None: nothing stored)
    retention: dict | None = None  # the retention that applies (its own over its tenant's), as a dict
