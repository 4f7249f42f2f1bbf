"""A conversation the service has in hand, and what a client is shown of it."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.history import Conversation
from statekeeper.kv_cache import KVCache


def utc_now() -> str:
    """A conversation's timestamps: ISO 8601 in UTC."""
    return datetime.now(timezone.utc).isoformat()


@dataclass(eq=False)
class LiveSession:
    conversation: Conversation
    cache: KVCache | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    in_turn: bool = False
    last_used: float = field(default_factory=time.monotonic)
    stats: AttentionStats | None = None  # gathered while the KV is active, for compression after offload
    last_pipeline: dict | None = None  # the last restore's recompute/load report, if it split the work
    last_layerwise: dict | None = None  # the last restore's layer-by-layer timeline, if it decoded that way
    last_device: dict | None = None  # the last restore's report, if a GPU worker's device restorer ran it
    last_exact_copy: str | None = None  # the tier the last restore read its kept entries from (an exact copy)
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
