"""Retention in the service (statekeeper/placement/retention.py): what applies to a conversation (its own
settings over its tenant's over every tenant's), a change of its settings (written to the history alone, told
to the placement policy at once), a change of a tenant's defaults at run time (kept in the history store,
where every replica's sweep reads them, over STATEKEEPER_TENANT_RETENTION's), and the sweep's TTL expiry
(the stored KV goes, the history stays)."""

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
        self.configured = tenant_defaults  # STATEKEEPER_TENANT_RETENTION
        self.set_at_run_time: dict[str, dict] = {}  # by an admin, from the history store
        self.tenant_defaults = dict(tenant_defaults)  # what applies: a tenant's run-time ones over configured
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

    async def set_tenant(self, tenant: str, settings: dict | None) -> Retention:
        """Replaces the tenant's run-time defaults ("*": every tenant's; None: its configured ones apply again);
        what now applies to its conversations (their own settings over these)."""
        settings = self.checked(settings)
        await self.in_io_thread(self.history.set_tenant_retention, tenant, settings)
        await self._apply({**self.set_at_run_time, tenant: settings})
        return Retention.of(self.tenant_defaults.get("*") if tenant != "*" else None, self.tenant_defaults.get(tenant))

    async def refresh(self) -> None:
        """Takes up the run-time defaults as the history store holds them (another replica's changes too)."""
        await self._apply(await self.in_io_thread(self.history.tenant_retention))

    async def _apply(self, set_at_run_time: dict[str, dict | None]) -> None:
        set_at_run_time = {tenant: settings for tenant, settings in set_at_run_time.items() if settings}
        defaults = self.configured | set_at_run_time
        changed = {tenant for tenant in defaults.keys() | self.tenant_defaults.keys()
                   if defaults.get(tenant) != self.tenant_defaults.get(tenant)}
        self.set_at_run_time, self.tenant_defaults = set_at_run_time, defaults
        if not changed:
            return
        tenants = None if "*" in changed else changed
        held = self.policy.held_of(tenants)
        if not held:
            return
        own = await self.in_io_thread(self._own_retention, tenants)
        for key, tenant in held:
            retention = Retention.of(defaults.get("*"), defaults.get(tenant), own.get(key))
            self.policy.retention(key, retention.pinned, retention.weight, retention.ttl_seconds)

    def _own_retention(self, tenants: set[str] | None) -> dict[str, dict]:
        if tenants is None:
            return self.history.own_retention()
        return {key: settings for tenant in tenants for key, settings in self.history.own_retention(tenant).items()}

    async def sweep(self) -> None:
        await self.refresh()
        await self.expire()

    async def expire(self) -> None:
        """Drops the stored KV of conversations whose TTL has passed since their last turn (a turn after it
        recomputes). One back in memory meanwhile keeps its KV."""
        for session_id in self.policy.expired():
            live = self.held(session_id)
            if live is not None and (live.cache is not None or live.in_turn):
                continue
            self.forget_stored(session_id)
            await self.in_io_thread(self.tiers.delete, session_id)
