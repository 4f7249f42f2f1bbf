"""The next turn's state, prepared in background time, for chat templates that render a history otherwise the
next time (a think block dropped, the system prompt moved: ChatFormatter.next_turn). After such a turn the
KV up to where the renderings part is kept, the rest of the next rendering (for a think-dropping template,
only the answer) is prefilled as background work on the model thread, and the conversation's tokens become
that rendering: the next turn is a pure append. A turn that arrives meanwhile takes over (the work stops
between chunks and the KV goes back to the shared part, which that turn keeps); a shared history (replicas)
is left as it is, since only a turn's lease may rewrite it."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from statekeeper.chat import ChatFormatter
from statekeeper.history import HistoryStore
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.kv_restore import KVRestorer
from statekeeper.sessions.live import LiveSession
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class NextTurnCounters:
    prepared: int = 0  # conversations whose next turn will only append
    abandoned: int = 0  # stopped for a turn that arrived, or a history that could not be written
    tokens: int = 0  # tokens prefilled in background time
    seconds: float = 0.0  # the model thread's CPU time for them


class NextTurnState:
    def __init__(self, worker: ModelWorker, formatter: ChatFormatter, history: HistoryStore, executors: Executors,
                 restorer: KVRestorer):
        self.worker = worker
        self.formatter = formatter
        self.history = history
        self.executors = executors
        self.restorer = restorer
        self.counters = NextTurnCounters()

    async def prepare(self, live: LiveSession) -> None:
        """Prepares `live`'s next turn where the template needs it; nothing for an append-only one."""
        conversation = live.conversation
        if self.history.is_shared or live.cache is None or live.deleted or live.in_turn or live.lock.locked():
            return
        plan = self.formatter.next_turn(conversation.tokens, conversation.chat_messages(), conversation.tools,
                                        conversation.template_options)
        if plan is None:
            return
        async with live.lock:
            if live.in_turn or live.deleted or live.conversation is not conversation or live.cache is None:
                return
            if not await self._prefill(live, plan.tokens, plan.common):
                self.counters.abandoned += 1
                return
            updated = dataclasses.replace(conversation, tokens=plan.tokens)
            try:
                await self.executors.in_io_thread(self.history.commit_turn, updated, conversation.turns, live.fence)
            except Exception as exc:  # the history keeps the old tokens: so must the KV
                log.warning("could not store the next turn's tokens of %s: %s", live.id, exc)
                live.cache.truncate(min(plan.common, live.cache.num_tokens))
                self.counters.abandoned += 1
                return
            live.conversation = updated
            self.counters.prepared += 1

    async def _prefill(self, live: LiveSession, tokens: list[int], common: int) -> bool:
        """The KV of `tokens` from `common` on, a prefill chunk per background job; False (the KV back at
        `common`) once a turn waits for the conversation."""
        cache = live.cache
        cache.truncate(min(common, cache.num_tokens))
        self.restorer.reset_stats(live)
        live.stored_tokens = None  # what is stored no longer matches what memory holds
        chunk = self.worker.config.prefill_chunk_tokens
        live.preparing = asyncio.current_task()  # a turn that arrives cancels it (TurnRunner.slot)
        try:
            for start in range(cache.num_tokens, len(tokens), chunk):
                if live.in_turn:
                    cache.truncate(min(common, cache.num_tokens))
                    return False
                piece = tokens[start : start + chunk]
                self.counters.seconds += await self.executors.in_model_thread(self._timed_prefill, cache, piece,
                                                                              live.stats, background=True)
                self.counters.tokens += len(piece)
        except asyncio.CancelledError:  # a turn came: a job in line never ran, one that ran is done
            cache.truncate(min(common, cache.num_tokens))
            return False
        finally:
            live.preparing = None
        return True

    def _timed_prefill(self, cache, tokens: list[int], stats) -> float:
        """On the model thread: the prefill, and the CPU time it took there."""
        started = time.thread_time()
        self.worker.prefill(cache, tokens, stats)
        return time.thread_time() - started

    def report(self) -> dict:
        return dataclasses.asdict(self.counters)
