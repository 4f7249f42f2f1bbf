"""How one replica's conversations in memory follow a history that other replicas share (PostgreSQL): the
lease a turn holds across replicas, the stored conversation taken when another replica moved it on, and a
conversation that another replica deleted forgotten here too. Over a history of its own (LMDB) a replica
leases nothing and never looks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from statekeeper.coordination import ConversationLeases, CoordinationUnavailable
from statekeeper.history import HistoryStore
from statekeeper.sessions.errors import ConversationBusy, HistoryDown, SessionNotFound
from statekeeper.sessions.executors import to_the_end
from statekeeper.sessions.live import LiveSession

log = logging.getLogger(__name__)

# How often a replica asks the shared history which of the conversations it holds still exist: a deleted
# conversation's memory is freed within this, and the history is asked once in this long, not every sweep.
DELETED_ELSEWHERE_CHECK_SECONDS = 5.0
# After the history could not answer: no sweep waits on its connect timeout again for this long.
DELETED_ELSEWHERE_RETRY_SECONDS = 30.0


class ReplicaSync:
    def __init__(self, history: HistoryStore, leases: ConversationLeases | None,
                 in_io_thread: Callable[..., Awaitable], forget: Callable[[LiveSession], Awaitable[None]],
                 in_lease_thread: Callable[..., Awaitable] | None = None):
        """`forget(live)` drops every trace of a deleted conversation in this replica (the session service's);
        `in_lease_thread` runs the lease calls (default: the I/O threads)."""
        self.history = history
        self.leases = leases
        self._in_io_thread = in_io_thread
        self._in_lease_thread = in_lease_thread or in_io_thread
        self._forget = forget
        self._next_deleted_check = 0.0  # time.monotonic()

    @contextlib.asynccontextmanager
    async def lease(self, live: LiveSession):
        """Holds the conversation's lease across replicas (statekeeper/coordination.py) for a turn, renewed
        while it runs; its fencing token goes with the turn's commit. A lease held elsewhere is waited for
        up to `wait_seconds`, then the turn is refused (409). Without coordination: nothing."""
        leases = self.leases
        if leases is None:
            yield
            return
        deadline = time.monotonic() + leases.wait_seconds
        while (lease := await self._try_lease(live.id)) is None:
            if time.monotonic() >= deadline:
                raise ConversationBusy("a turn on this conversation is under way on another replica: try again")
            await asyncio.sleep(0.02)
        renewing = asyncio.ensure_future(self._renew_forever(lease))
        live.fence = lease.fence
        try:
            yield
        finally:
            live.fence = None
            renewing.cancel()
            await to_the_end(self._release(renewing, lease))  # also for a client that left (its task cancelled)

    async def _release(self, renewing: asyncio.Future, lease) -> None:
        await asyncio.gather(renewing, return_exceptions=True)
        await self._in_lease_thread(self.leases.release, lease)

    async def _try_lease(self, session_id: str):
        try:
            return await self._in_lease_thread(self.leases.try_acquire, session_id)
        except CoordinationUnavailable as exc:
            raise HistoryDown("the lease store cannot be reached now: no turn can run, try again later") from exc

    async def _renew_forever(self, lease) -> None:
        """Renews the lease every third of its time to live. A renewal that cannot reach Redis is tried again
        while the lease would still hold (one failure ended the renewals, and the lease expired under the turn)."""
        ttl_s = self.leases.ttl_ms / 1000
        renewed_at = time.monotonic()
        while True:
            await asyncio.sleep(ttl_s / 3)
            renewed = await self._in_lease_thread(self.leases.renew, lease)
            if renewed:
                renewed_at = time.monotonic()
            elif renewed is False or time.monotonic() - renewed_at >= ttl_s:
                # Another replica may hold it now: this turn's commit is checked by its fencing token.
                log.warning("the lease on %s was lost during a turn", lease.conversation_id)
                return

    async def forget_lease(self, session_id: str) -> None:
        """A deleted conversation's lease keys go with it."""
        if self.leases is not None:
            await self._in_lease_thread(self.leases.forget, session_id)

    async def follow(self, live: LiveSession) -> None:
        """A read of a conversation that other replicas may have moved on shows the stored one (a turn
        under way here shows what it started from)."""
        if self.history.is_shared and not live.in_turn:
            async with live.lock:
                await self.refresh(live)

    async def refresh(self, live: LiveSession) -> None:
        """Takes the stored conversation if another replica changed it: committed turns that this one has not
        seen (its KV in memory no longer matches and is dropped) or its settings (retention). Called while
        holding the session; over a history of this replica's own, nothing."""
        if not self.history.is_shared:
            return
        stored = await self._in_io_thread(self.history.load, live.id)
        if stored is None:  # deleted on another replica: gone here too, now
            await self._forget(live)
            raise SessionNotFound(f"session {live.id} not found")
        if (stored.tokens, stored.messages) == (live.conversation.tokens, live.conversation.messages):
            # Settings another replica changed (retention): the KV still fits, and the next commit writes them
            if stored != live.conversation:
                live.conversation = stored
            return
        live.conversation, live.cache, live.stats, live.stored_tokens = stored, None, None, None

    async def forget_deleted(self, held: list[LiveSession]) -> None:
        """Forgets the conversations held here (KV, blobs, place in memory) that another replica deleted: one
        look at the shared history for all of them, each sweep, so a deleted conversation's KV does not wait
        for its idle offload, which nobody would ever ask this replica for again. A conversation in a turn, or
        whose lock a request holds, is left to that request (its commit or refresh finds it gone). Asked at
        most every DELETED_ELSEWHERE_CHECK_SECONDS; a history that cannot answer, again after
        DELETED_ELSEWHERE_RETRY_SECONDS (an I/O thread waiting on a connect timeout every sweep would hold
        up the turns' own history calls)."""
        candidates = [live for live in held if not live.in_turn and not live.deleted]
        now = time.monotonic()
        if not self.history.is_shared or not candidates or now < self._next_deleted_check:
            return
        self._next_deleted_check = now + DELETED_ELSEWHERE_CHECK_SECONDS
        try:
            stored = await self._in_io_thread(self.history.existing, [live.id for live in candidates])
        except Exception as exc:
            self._next_deleted_check = time.monotonic() + DELETED_ELSEWHERE_RETRY_SECONDS
            log.warning("could not check which conversations other replicas deleted: %s", exc)
            return
        for live in candidates:
            if live.id not in stored and not live.lock.locked() and not live.in_turn:
                async with live.lock:
                    await self._forget(live)

    async def has_moved_on(self, session_id: str, tokens: list[int]) -> bool:
        """Whether a shared history no longer holds `tokens` for the conversation: another replica ran a turn on
        it (and may have stored its newer state) or deleted it. Over a history of this replica's own, False."""
        if not self.history.is_shared:
            return False
        stored = await self._in_io_thread(self.history.load, session_id)
        return stored is None or stored.tokens != tokens

    async def is_deleted_elsewhere(self, session_id: str) -> bool:
        """After a write of a shared history's conversation's KV: whether another replica deleted it meanwhile.
        A delete removes the history first and the blobs after, so a blob written before this check is
        removed by that delete, and one written after it is caught here."""
        return self.history.is_shared and not await self._in_io_thread(self.history.exists, session_id)
