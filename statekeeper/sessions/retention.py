"""Retention in the service (statekeeper/placement/retention.py): what applies to a conversation (its own
settings over its tenant's over every tenant's), a change of its settings (written to the history alone, told
to the placement policy at once), a change of a tenant's defaults at run time (kept in the history store,
where every replica's sweep reads them, over STATEKEEPER_TENANT_RETENTION's), and the sweep's TTL expiry
(the stored KV goes, the history stays)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from statekeeper.history import Conversation, HistoryStore
from statekeeper.placement.policy import LruPlacement, ValuePolicy
from statekeeper.placement.retention import Retention, checked
from statekeeper.sessions.errors import InvalidRequest, SessionNotFound
from statekeeper.sessions.exact_copy import delete_stored
from statekeeper.sessions.live import LiveSession, epoch_seconds
from storage.manager import TierManager

log = logging.getLogger(__name__)
REFRESH_EVERY_S = 10.0  # how soon a replica takes up the tenants' retention defaults another one changed


def applying(defaults: dict[str, dict], tenant: str, own: dict | None = None) -> Retention:
    """What applies to a conversation of `tenant` with settings `own`: those over its tenant's defaults over
    every tenant's ("*"; for tenant "*" the same layer twice, which changes nothing)."""
    return Retention.of(defaults.get("*"), defaults.get(tenant), own)


@contextlib.asynccontextmanager
async def _unleased(live: LiveSession) -> AsyncIterator[None]:
    yield


class RetentionControl:
    def __init__(self, tenant_defaults: dict[str, dict], history: HistoryStore, tiers: TierManager,
                 policy: LruPlacement | ValuePolicy, in_io_thread: Callable[..., Awaitable],
                 held: Callable[[str], LiveSession | None], forget_stored: Callable[[str], None]):
        """`held(id)`: the conversation if in memory (the registry's); `forget_stored(id)`: what the service
        drops of a stored blob before it is deleted (its pending compression, its remembered meta)."""
        self.configured = tenant_defaults  # STATEKEEPER_TENANT_RETENTION
        self.set_at_run_time: dict[str, dict] = {}  # by an admin, from the history store
        self.tenant_defaults = dict(tenant_defaults)  # what applies: a tenant's run-time ones over configured
        self._changing = asyncio.Lock()  # one change of settings at a time: each reads, writes, then tells the policy
        self._refreshed_at = -math.inf
        self.history = history
        self.tiers = tiers
        self.policy = policy
        self.in_io_thread = in_io_thread
        self.held = held
        self.forget_stored = forget_stored

    def of(self, conversation: Conversation) -> Retention:
        return applying(self.tenant_defaults, conversation.tenant, conversation.retention)

    @staticmethod
    def checked(settings: dict | None) -> dict | None:
        """A conversation's own settings as stored (None: none); InvalidRequest for bad ones."""
        try:
            return checked(settings)
        except (ValueError, TypeError) as exc:
            raise InvalidRequest(f"retention: {exc}") from None

    async def replace(self, live: LiveSession, settings: dict | None,
                      leased: Callable[[LiveSession], contextlib.AbstractAsyncContextManager] = _unleased) -> None:
        """`leased(live)`: the conversation's lease across replicas (ReplicaSync.lease), held for the write as a
        turn holds it, so that a turn on another replica, whose commit writes every field, does not write the
        old settings back over these."""
        settings = self.checked(settings)
        async with live.lock, self._changing, leased(live):  # no tenant change reapplies a stale copy meanwhile
            if not await self.in_io_thread(self.history.set_retention, live.id, settings):
                raise SessionNotFound(live.id)
            live.conversation = dataclasses.replace(live.conversation, retention=settings)
            retention = self.of(live.conversation)
            self.policy.retention(live.id, retention.pinned, retention.weight, retention.ttl_seconds)

    async def set_tenant(self, tenant: str, settings: dict | None) -> Retention:
        """Replaces the tenant's run-time defaults ("*": every tenant's; None: its configured ones apply again);
        what now applies to its conversations (their own settings over these)."""
        settings = self.checked(settings)
        async with self._changing:
            await self.in_io_thread(self.history.set_tenant_retention, tenant, settings)
            defaults = await self._apply({**self.set_at_run_time, tenant: settings})
        return applying(defaults, tenant)

    async def refresh(self) -> None:
        """Takes up the run-time defaults as the history store holds them (another replica's changes too)."""
        async with self._changing:
            await self._apply(await self.in_io_thread(self.history.tenant_retention))

    async def _apply(self, set_at_run_time: dict[str, dict | None]) -> dict[str, dict]:
        """Makes `set_at_run_time` the run-time defaults and tells the policy of every conversation of a tenant
        whose defaults changed; returns the defaults that apply now."""
        set_at_run_time = {tenant: settings for tenant, settings in set_at_run_time.items() if settings}
        defaults = self.configured | set_at_run_time
        changed = {tenant for tenant in defaults.keys() | self.tenant_defaults.keys()
                   if defaults.get(tenant) != self.tenant_defaults.get(tenant)}
        self.set_at_run_time, self.tenant_defaults = set_at_run_time, defaults
        if changed:
            conversations = await self.in_io_thread(self._conversations_of, None if "*" in changed else changed)
            for key, (tenant, own) in conversations.items():
                retention = applying(defaults, tenant, own)
                self.policy.retention(key, retention.pinned, retention.weight, retention.ttl_seconds)
        return defaults

    def _conversations_of(self, tenants: set[str] | None) -> dict[str, tuple[str, dict | None]]:
        """Every conversation of `tenants` (None: of all), with its tenant and its own settings, from the
        history (the policy holds a blob adopted at start-up under no tenant). The policy ignores those it
        does not hold."""
        found = {}
        for tenant in self.history.tenants() if tenants is None else tenants:
            own = self.history.own_retention(tenant)
            found |= {key: (tenant, own.get(key)) for key in self.history.tenant_ids(tenant)}
        return found

    async def sweep(self) -> None:
        """A shared history's run-time defaults every REFRESH_EVERY_S (another replica may have changed them;
        an unshared one only this process writes), then the TTL expiry."""
        if self.history.is_shared and time.monotonic() - self._refreshed_at >= REFRESH_EVERY_S:
            self._refreshed_at = time.monotonic()
            try:
                await self.refresh()
            except Exception as exc:  # the history is down: the defaults held stay, a later sweep tries again
                log.warning("could not read the tenants' retention defaults: %s", exc)
        await self.expire()

    async def expire(self) -> None:
        """Drops the stored KV of conversations whose TTL has passed since their last turn (a turn after it
        recomputes). One back in memory meanwhile keeps its KV."""
        due, history_down = self.policy.expired(), False
        for session_id in due:
            live = self.held(session_id)
            if live is not None and (live.cache is not None or live.in_turn):
                continue
            if self.history.is_shared:
                if history_down:  # nothing is deleted on a guess: a later sweep asks again
                    self.policy.expire_at(session_id, self.policy.clock() + REFRESH_EVERY_S)
                    continue
                try:
                    if await self._kept_elsewhere(session_id):
                        continue
                except Exception as exc:  # noqa: BLE001 - one connect timeout per pass, not one per conversation
                    log.warning("could not read the history before a TTL expiry: %s", exc)
                    history_down = True
                    self.policy.expire_at(session_id, self.policy.clock() + REFRESH_EVERY_S)
                    continue
            self.forget_stored(session_id)
            await self.in_io_thread(delete_stored, self.tiers, session_id)

    async def _kept_elsewhere(self, session_id: str) -> bool:
        """Over a shared history, whether the stored KV stays though this replica's TTL clock ran out (only its
        own turns and settings reach that clock): another replica removed the TTL, or ran a later turn (the
        expiry is then counted again from that turn)."""
        stored = await self.in_io_thread(self.history.load, session_id)
        if stored is None:  # deleted: its blobs go
            return False
        ttl = self.of(stored).ttl_seconds
        if ttl is None:  # no TTL any more (set so on another replica)
            return True
        last = epoch_seconds(stored.updated_at)
        left = 0.0 if last is None else ttl - (time.time() - last)
        if left <= 0:
            return False
        self.policy.expire_at(session_id, self.policy.clock() + left)
        return True
