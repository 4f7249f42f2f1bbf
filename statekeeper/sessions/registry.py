"""The conversations the session service holds in memory, least recently used first: found by id (loaded
from the history when absent, another tenant's not found), and bounded. Active KV idle for
`idle_offload_seconds`, and the least recently used beyond the active KV budget, goes to storage; idle
conversations beyond `max_idle_sessions` or `max_idle_bytes` leave memory (the history and the tiers keep
them, so they come back whole)."""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator

from statekeeper.config import SessionConfig
from statekeeper.history import Conversation, HistoryStore
from statekeeper.placement.retention import Retention
from statekeeper.sessions.blob_meta import BlobMetaCache
from statekeeper.sessions.errors import SessionNotFound
from statekeeper.sessions.live import LiveSession
from statekeeper.tenancy import DEFAULT_TENANT

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what secrets.token_urlsafe gives, and the API admits


class SessionRegistry:
    def __init__(self, config: SessionConfig, history: HistoryStore, in_io_thread: Callable[..., Awaitable],
                 store: Callable[[LiveSession], Awaitable[None]], stored_forms: BlobMetaCache,
                 retention_of: Callable[[Conversation], Retention]):
        """`store(live)` moves a conversation's KV to storage and frees it (the placement's); `retention_of`
        says which conversations the active budget offloads last (pinned, then higher priority)."""
        self.config = config
        self.history = history
        self._in_io_thread = in_io_thread
        self._store = store
        self._stored_forms = stored_forms
        self._retention_of = retention_of
        self._live: OrderedDict[str, LiveSession] = OrderedDict()  # least recently used first
        self._deletions = 0  # conversations deleted so far (drop_deleted)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveSession]:
        return iter(list(self._live.values()))

    def add(self, conversation: Conversation) -> LiveSession:
        live = self._live[conversation.id] = LiveSession(conversation)
        self.forget_idle()
        return live

    async def get(self, session_id: str, tenant: str | None = DEFAULT_TENANT) -> LiveSession:
        """The session, loaded from the history if it is not in memory. Another tenant's session is not
        found, with the same answer as one that does not exist; `tenant=None` is the service's own access.
        An id that cannot be one (a client's hint: empty, or past what the store can key) is not looked up."""
        if not SESSION_ID.fullmatch(session_id):
            raise SessionNotFound(f"session {session_id[:64]} not found")
        live = self._live.get(session_id)
        if live is None:
            deletions = self._deletions
            conversation = await self._in_io_thread(self.history.load, session_id)
            if conversation is not None and self._deletions != deletions:
                # A conversation was deleted while this read ran; it may have read this one from before
                conversation = await self._in_io_thread(self.history.load, session_id)
            if conversation is None:
                raise SessionNotFound(f"session {session_id} not found")
            live = self._live.setdefault(session_id, LiveSession(conversation))
        self._live.move_to_end(session_id)
        if live.deleted or (tenant is not None and live.conversation.tenant != tenant):
            raise SessionNotFound(f"session {session_id} not found")
        return live

    def held(self, session_id: str) -> LiveSession | None:
        """The conversation as held in memory now (its KV, if active), without loading it; None if not held."""
        return self._live.get(session_id)

    def drop(self, session_id: str) -> None:
        self._live.pop(session_id, None)

    def drop_deleted(self, session_id: str) -> None:
        """Drops a conversation deleted from the history: a read of it begun before the delete is not taken."""
        self._deletions += 1
        self._live.pop(session_id, None)

    def active(self) -> list[LiveSession]:
        return [live for live in self._live.values() if live.cache is not None]

    async def sweep(self) -> None:
        """Offloads idle sessions, then least recently used ones while the active pool is over budget.
        One session that fails to offload is logged and dropped from memory; the others go on."""
        now = time.monotonic()
        for live in list(self._live.values()):
            if live.cache is not None and not live.in_turn and now - live.last_used >= self.config.idle_offload_seconds:
                await self._store_or_drop(live)
        await self.enforce_budget()
        self.forget_idle()

    def forget_idle(self) -> None:
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
            self._stored_forms.pop(live.id)
            count, held = count - 1, held - live.estimated_bytes

    def active_bytes(self) -> int:
        """What the active conversations' KV holds."""
        return sum(live.cache.allocated_bytes for live in self.active())

    async def enforce_budget(self) -> None:
        """Offloads active conversations until the active KV fits its budget: unpinned before pinned, lower
        priority before higher, least recently used first."""

        def keep_longer(live: LiveSession) -> tuple:
            retention = self._retention_of(live.conversation)
            return retention.pinned, retention.weight, live.last_used

        active = sorted(self.active(), key=keep_longer)
        used = self.active_bytes()
        for live in active:
            if used <= self.config.active_kv_budget_bytes:
                break
            if not live.in_turn and live.cache is not None:
                used -= live.cache.allocated_bytes
                await self._store_or_drop(live)

    async def _store_or_drop(self, live: LiveSession) -> None:
        try:
            await self._store(live)
        except Exception:
            log.exception("offloading %s failed: its KV is dropped and will be recomputed", live.id)
            live.cache, live.stats = None, None

    def report(self) -> dict:
        """What the admin API shows of the sessions in memory (read on the event loop's thread)."""
        active = self.active()
        idle = [live for live in self._live.values() if live.cache is None]
        return {"sessions_in_memory": len(self._live), "active_sessions": len(active),
                "active_kv_bytes": self.active_bytes(),
                "idle_sessions": {"count": len(idle), "max_count": self.config.max_idle_sessions,
                                  "bytes": sum(live.estimated_bytes for live in idle),
                                  "max_bytes": self.config.max_idle_bytes}}
