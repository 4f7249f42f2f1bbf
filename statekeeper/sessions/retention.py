"""Retention in the service (statekeeper/placement/retention.py): what applies to a conversation (its own
settings over its tenant's over every tenant's), a change of its settings (written to the history alone, told
to the placement policy at once), and the sweep's TTL expiry (the stored KV goes, the history stays)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from statekeeper.history import Conversation, HistoryStore
from statekeeper.placement.policy import LruPlacement, ValuePolicy
from statekeeper.placement.retention import Retention, checked
from statekeeper.sessions.errors import InvalidRequest, SessionNotFound
from statekeeper.sessions.live import LiveSession
from storage.manager import TierManager


class RetentionControl:
    def __init__(self, tenant_defaults: dict[str, dict], history: HistoryStore, tiers: TierManager,
                 policy: LruPlacement | ValuePolicy, in_io_thread: Callable[..., Awaitable],
                 held: Callable[[str], LiveSession | None], forget_stored: Callable[[str], None]):
        """`held(id)`: the conversation if in memory (the registry's); `forget_stored(id)`: what the service
        drops of a stored blob before it is deleted (its pending compression, its remembered meta)."""
        self.tenant_defaults = tenant_defaults
        self.history = history
        self.tiers = tiers
        self.policy = policy
        self.in_io_thread = in_io_thread
        self.held = held
        self.forget_stored = forget_stored

    def of(self, conversation: Conversation) -> Retention:
        defaults = self.tenant_defaults
        return Retention.of(defaults.get("*"), defaults.get(conversation.tenant), conversation.retention)

    @staticmethod
    def checked(settings: dict | None) -> dict | None:
        """A conversation's own settings as stored (None: none); InvalidRequest for bad ones."""
        try:
            return checked(settings)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"retention: {exc}") from None

    async def replace(self, live: LiveSession, settings: dict | None) -> None:
        settings = self.checked(settings)
        async with live.lock:
            if not await self.in_io_thread(self.history.set_retention, live.id, settings):
                raise SessionNotFound(live.id)
            live.conversation = dataclasses.replace(live.conversation, retention=settings)
            retention = self.of(live.conversation)
            self.policy.retention(live.id, retention.pinned, retention.weight, retention.ttl_seconds)

    async def expire(self) -> None:
        """Drops the stored KV of conversations whose TTL has passed since their last turn (a turn after it
        recomputes). One back in memory meanwhile keeps its KV."""
        for session_id in self.policy.expired():
            live = self.held(session_id)
            if live is not None and (live.cache is not None or live.in_turn):
                continue
            self.forget_stored(session_id)
            await self.in_io_thread(self.tiers.delete, session_id)
