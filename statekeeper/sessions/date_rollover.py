"""Midnight for templates that write today's date (Llama 3.x's "Today Date", transformers' `strftime_now`). The
date sits in the system turn at the start of every prompt, so the first turn of each conversation after a
midnight shares only a few tokens with its stored state: a full recompute, which no prefix cache avoids. The
service knows when its date changes (local time, TZ, which `strftime_now` reads), so at that moment the
conversations likely to come back get their next turn's state prepared in background time
(sessions/next_turn.py), those whose KV is stored too, the likeliest first; their next turn only appends. A
turn that arrives first takes over, as it does from any preparation. Conversations whose client sends the
date itself (`chat_template_kwargs`) render as before and are left alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta

from statekeeper.placement.policy import HORIZON_S, MIN_RETURN, SOON_S
from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.next_turn import NextTurnState

log = logging.getLogger(__name__)

MAX_SLEEP_S = 60.0  # the clock is read again at least this often (it may be set, or the offset change)


def seconds_to_midnight(now: datetime) -> float:
    """Seconds from the naive local time `now` to the next midnight."""
    tomorrow = datetime.combine(now.date() + timedelta(days=1), datetime.min.time())
    return (tomorrow - now).total_seconds()


class DateRollover:
    def __init__(self, conversations: Callable[[], list[LiveSession]], next_turn: NextTurnState,
                 return_chance: Callable[[str, float], float], enforce_budget: Callable[[], Awaitable[None]],
                 lanes: int = 1, today: Callable[[], date] = date.today):
        """`conversations()`: those held in memory (their KV active or stored); `return_chance(id, within_s)`:
        the placement policy's; `enforce_budget()`: offloads active KV beyond its budget, which the states
        prepared from storage join; `lanes`: the model lanes that take background jobs, one conversation on
        each at a time (the date change finds most of them idle: returning users' turns come after it)."""
        self._conversations = conversations
        self.next_turn = next_turn
        self._return_chance = return_chance
        self._enforce_budget = enforce_budget
        self.lanes = lanes
        self._today = today
        self.date = today()

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(min(MAX_SLEEP_S, seconds_to_midnight(datetime.now()) + 0.01))
            try:
                await self.check()
            except Exception:  # the next check tries the conversations left
                log.exception("preparing the next turns after a date change failed")

    async def check(self) -> int:
        """If the date changed since the last check: the next turns of the conversations likely to return
        within HORIZON_S (the placement policy's bar for spending CPU on a stored state), likeliest soon first;
        how many were prepared."""
        today = self._today()
        if today == self.date:
            return 0
        self.date = today
        self.next_turn.counters.date_changes += 1
        candidates = [(self._return_chance(live.id, SOON_S), live) for live in self._conversations()
                      if live.conversation.tokens and not live.deleted
                      and self._return_chance(live.id, HORIZON_S) >= MIN_RETURN]
        candidates.sort(key=lambda pair: -pair[0])
        waiting = [live for _, live in candidates]
        counts = await asyncio.gather(*(self._prepare_in_turn(waiting, today, lane) for lane in range(self.lanes)))
        prepared = sum(counts)
        self.next_turn.counters.after_date_change += prepared
        log.info("the date changed to %s: %d of %d conversations' next turns prepared", today, prepared,
                 len(candidates))
        return prepared

    async def _prepare_in_turn(self, waiting: list[LiveSession], today: date, lane: int) -> int:
        """Takes the likeliest conversation left in `waiting` and prepares it on background lane `lane`, until
        none is left; how many it prepared."""
        prepared = 0
        while waiting:
            if self._today() != today:  # another midnight: the next check starts over
                break
            live = waiting.pop(0)
            # A task of its own, as after a turn: a turn that arrives cancels this preparation, not the loop.
            job = asyncio.ensure_future(self.next_turn.prepare(live, from_storage=True, lane=lane))
            await asyncio.wait([job])
            if job.cancelled():
                continue
            if job.exception() is not None:
                log.error("preparing %s's next turn failed", live.id, exc_info=job.exception())
            elif job.result():
                prepared += 1
                await self._enforce_budget()
        return prepared
