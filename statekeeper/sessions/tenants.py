"""Each tenant's limits (statekeeper.tenancy.TenantLimits) held against what it uses: conversations and
stored bytes (from the history's tenant index and the tiers), requests in the last minute and turns under
way (counted here). A limit reached is TenantLimitReached (429 with Retry-After)."""

from __future__ import annotations

import collections
import contextlib

from statekeeper.history import HistoryStore
from statekeeper.sessions.errors import TenantLimitReached
from statekeeper.sessions.exact_copy import copy_key
from statekeeper.tenancy import RequestWindow, TenantLimits, retry_after
from storage.manager import TierManager

# What frees a conversation or stored bytes is the tenant's own DELETE (or the tiers' eviction), not the
# clock: the Retry-After of those limits only says when asking again is reasonable.
HOLDING_RETRY_S = 60
TURN_RETRY_S = 1


class TenantGuard:
    def __init__(self, limits: TenantLimits, history: HistoryStore, tiers: TierManager):
        self.limits = limits
        self.history = history
        self.tiers = tiers
        self.requests = RequestWindow(limits.requests_per_minute)
        self.turns: collections.Counter[str] = collections.Counter()

    def admit_request(self, tenant: str) -> None:
        wait = self.requests.admit(tenant)
        if wait is not None:
            raise TenantLimitReached(f"over {self.limits.requests_per_minute} requests per minute",
                                     retry_after(wait))

    def save_new_conversation(self, conversation) -> None:
        """Saves a new conversation within its tenant's limits: the conversations it holds (counted and saved
        as one step: HistoryStore.save_new) and its stored bytes. Blocking: run it on an I/O thread."""
        self.check_stored_bytes(conversation.tenant)
        if not self.history.save_new(conversation, self.limits.sessions or None):
            raise TenantLimitReached(f"the tenant holds {self.limits.sessions} conversations, its limit: "
                                     "delete some first", HOLDING_RETRY_S)

    @property
    def limits_holdings(self) -> bool:
        """Whether conversations or stored bytes are limited (their checks read the history)."""
        return bool(self.limits.sessions or self.limits.stored_bytes)

    def check_stored_bytes(self, tenant: str) -> None:
        """Blocking (reads the history): run it on an I/O thread."""
        if self.limits.stored_bytes and self.stored_bytes(tenant) >= self.limits.stored_bytes:
            raise TenantLimitReached(f"the tenant's stored states hold {self.limits.stored_bytes} bytes, its "
                                     "limit: delete conversations first", HOLDING_RETRY_S)

    @contextlib.contextmanager
    def turn(self, tenant: str):
        """Counts a turn under way, or refuses one more than the tenant's limit (on the event loop, so the
        check and the count are one step)."""
        if self.limits.concurrent_turns and self.turns[tenant] >= self.limits.concurrent_turns:
            raise TenantLimitReached(f"the tenant has {self.limits.concurrent_turns} turns under way, its limit",
                                     TURN_RETRY_S)
        self.turns[tenant] += 1
        try:
            yield
        finally:
            self.turns[tenant] -= 1
            if not self.turns[tenant]:
                del self.turns[tenant]

    def stored_bytes(self, tenant: str) -> int:
        """Its conversations' blobs and their exact copies (sessions/exact_copy.py: stored state too)."""
        return sum(self.tiers.stored_bytes(key) or 0 for session_id in self.history.tenant_ids(tenant)
                   for key in (session_id, copy_key(session_id)))

    def usage(self) -> list[dict]:
        """Blocking: every tenant with a conversation or a turn, and what it uses."""
        tenants = sorted(set(self.history.tenants()) | set(self.turns))
        return [{"tenant": tenant, "sessions": self.history.count(tenant), "stored_bytes": self.stored_bytes(tenant),
                 "requests_last_minute": self.requests.count(tenant), "turns_in_progress": self.turns[tenant]}
                for tenant in tenants]
