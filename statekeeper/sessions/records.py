"""What the API keeps besides conversations: API keys and their tenants (statekeeper/tenancy.py) and the
stored bodies of /v1/responses (the history's), each call off the event loop."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from statekeeper.history import HistoryStore, StoredResponse
from statekeeper.tenancy import ApiKey, KeyStore, PostgresKeyStore


class Records:
    def __init__(self, keys: KeyStore | PostgresKeyStore | None, history: HistoryStore,
                 in_io_thread: Callable[..., Awaitable]):
        self.keys = keys  # None: the service runs without API keys (AUTH=none)
        self.history = history
        self.in_io_thread = in_io_thread

    def tenant_of_key(self, key: str) -> str | None:
        """The tenant of an API key; None for a key that is not (or no longer) valid, or without keys."""
        return None if self.keys is None else self.keys.tenant_of(key)

    async def create_key(self, tenant: str) -> tuple[ApiKey, str]:
        return await self.in_io_thread(self.keys.create, tenant)

    async def list_keys(self) -> list[ApiKey]:
        return await self.in_io_thread(self.keys.list)

    async def revoke_key(self, key_id: str) -> bool:
        return await self.in_io_thread(self.keys.revoke, key_id)

    async def save_response(self, stored: StoredResponse) -> None:
        await self.in_io_thread(self.history.save_response, stored)

    async def load_response(self, response_id: str) -> StoredResponse | None:
        return await self.in_io_thread(self.history.load_response, response_id)

    async def delete_response(self, response_id: str) -> None:
        await self.in_io_thread(self.history.delete_response, response_id)

    def close(self) -> None:
        if self.keys is not None:
            self.keys.close()
