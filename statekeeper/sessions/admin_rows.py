"""The admin dashboard's conversation table: a page of every tenant's conversations by id, each as the
service knows it now (in memory or only in the history; active or where its stored blob is and in what
form). Listing loads nothing into memory."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import datetime, timezone

from statekeeper.compression.form import StoredForm
from statekeeper.history import Conversation, HistoryStore
from statekeeper.sessions.live import epoch_seconds
from statekeeper.sessions.registry import SessionRegistry
from storage.manager import TierManager


class AdminRows:
    def __init__(self, history: HistoryStore, sessions: SessionRegistry, tiers: TierManager,
                 stored_form: Callable[[str], StoredForm | None], policy: Callable[[Conversation], str],
                 in_io_thread: Callable[..., Awaitable]):
        """`stored_form(id)`: what the stored blob holds (the placement's); `policy(conversation)`: its compression."""
        self.history = history
        self.sessions = sessions
        self.tiers = tiers
        self._stored_form = stored_form
        self._policy = policy
        self._in_io_thread = in_io_thread

    async def page(self, prefix: str = "", after: str = "", limit: int = 50) -> tuple[list[dict], str | None]:
        """The admin dashboard's table: a page of every tenant's conversations by id (HistoryStore.page),
        each as the service knows it now, and the id the next page starts after (None: the last page). Those
        deleted meanwhile drop out of the page, which still leads on from the ids it scanned. Listing loads
        nothing into memory."""
        ids = await self._in_io_thread(self.history.page, prefix, after, limit + 1)
        next_after = ids[limit - 1] if len(ids) > limit else None
        return await self._rows_of(ids[:limit]), next_after

    async def _rows_of(self, ids: list[str]) -> list[dict]:
        missing = [session_id for session_id in ids if self.sessions.held(session_id) is None]
        loaded = await self._in_io_thread(lambda: {i: self.history.load(i) for i in missing})
        rows = []
        for session_id in ids:
            live = self.sessions.held(session_id)
            conversation = live.conversation if live is not None else loaded.get(session_id)
            if conversation is None or (live is not None and live.deleted):
                continue  # deleted meanwhile
            # Its last committed turn (or its creation): not when it was loaded into memory (an admin's prefetch
            # showed it active "just now"), nor a turn refused or failed.
            rows.append({"id": session_id, "conversation": conversation,
                         "is_active": live is not None and live.cache is not None,  # read here, on the loop
                         "last_active": epoch_seconds(conversation.updated_at or conversation.created_at)})
        return await self._in_io_thread(self._rows, rows)

    def _rows(self, rows: list[dict]) -> list[dict]:
        """The rows' stored forms, read from the tiers on an I/O thread."""
        out = []
        for row in rows:
            session_id, conversation, is_active = row["id"], row["conversation"], row["is_active"]
            tier = None if is_active else self.tiers.locate(session_id)
            form = None if tier is None else self._stored_form(session_id)
            out.append({
                "id": session_id, "tenant": conversation.tenant, "state": "active" if is_active else "inactive",
                "tier": tier, "turns": conversation.turns, "tokens": len(conversation.tokens),
                "stored_bytes": None if tier is None else self.tiers.stored_bytes(session_id),
                "codec": None if form is None else form.codec_name,
                "policy": self._policy(conversation),
                "created_at": conversation.created_at,
                "last_active": None if row["last_active"] is None else
                datetime.fromtimestamp(row["last_active"], timezone.utc).isoformat(timespec="seconds"),
            })
        return out

