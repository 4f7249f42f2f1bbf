"""Midnight for templates that write today's date (Llama 3.x's "Today Date", transformers' `strftime_now`). The
date sits in the system turn at the start of every prompt, so the first turn of each conversation after a
midnight shares only a few tokens with its stored state: a full recompute, which no prefix cache avoids. The
service knows when its date changes (local time, TZ, which `strftime_now` reads), so at that moment the
conversations likely to come back get their next turn's state prepared in background time
(sessions/next_turn.py), those whose KV is stored too, the likeliest first; their next turn only appends. A
turn that arrives first takes over, as it does from any preparation. Conversations whose client sends the
date itself (`chat_template_kwargs`) render as before and are left alone.

Before the midnight, as long before it as preparing them all would take (twice over, spread over the
background lanes: live turns share the cores), their states for the new date are prefilled too, each into a
cache of its own (NextTurnState.prepare_ahead, the template rendering the date after the midnight:
ChatFormatter.on_date), and extended after each turn meanwhile: at the change the preparation takes them up
and has nothing or little left to do. Users who came back a second after a midnight found their state not
begun and recomputed it (BENCHMARKS.md, issue 30). These states hold memory of their own until the change,
within what the active KV budget leaves free."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta

from statekeeper.chat import ChatFormatter
from statekeeper.placement.policy import HORIZON_S, MIN_RETURN, SOON_S
from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.next_turn import NextTurnState

log = logging.getLogger(__name__)

MAX_SLEEP_S = 60.0  # the clock is read again at least this often (it may be set, or the offset change)
# How long before a midnight the states for the next date begin: at least MIN_LEAD_S, at most MAX_LEAD_S, and
# all of it (MAX) where no compute profile says what a prefill costs here.
MIN_LEAD_S, MAX_LEAD_S = 10.0, 900.0
AHEAD_POLL_S = 1.0  # within the lead, how soon conversations that a turn changed are taken up again


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
        each at a time (the date change finds most of them idle: returning users' turns come after it). The
        states prepared before a midnight take the room `next_turn.room()` gives (None: none are)."""
        self._conversations = conversations
        self.next_turn = next_turn
        self._return_chance = return_chance
        self._enforce_budget = enforce_budget
        self.lanes = lanes
        self._today = today
        self.date = today()
        self._on_date: tuple[date, ChatFormatter | None] | None = None  # the formatter of the coming date

    async def run_forever(self) -> None:
        while True:
            to_midnight = seconds_to_midnight(datetime.now())
            if self.next_turn.room is None:
                await asyncio.sleep(min(MAX_SLEEP_S, to_midnight + 0.01))
            elif to_midnight <= (lead := self.lead_s()):
                await self._ahead_until(to_midnight)
            else:  # the lead grows with the conversations: read again halfway
                await asyncio.sleep(min(MAX_SLEEP_S, to_midnight + 0.01, max(AHEAD_POLL_S, (to_midnight - lead) / 2)))
            try:
                await self.check()
            except Exception:  # the next check tries the conversations left
                log.exception("preparing the next turns after a date change failed")

    def _candidates(self) -> list[LiveSession]:
        """The conversations likely to return within HORIZON_S (the placement policy's bar for spending CPU on a
        stored state), likeliest soon first."""
        candidates = [(self._return_chance(live.id, SOON_S), live) for live in self._conversations()
                      if live.conversation.tokens and not live.deleted
                      and self._return_chance(live.id, HORIZON_S) >= MIN_RETURN]
        candidates.sort(key=lambda pair: -pair[0])
        return [live for _, live in candidates]

    def lead_s(self) -> float:
        """How long before a midnight the states for the next date begin: twice what prefilling the likely
        conversations' histories costs here, spread over the background lanes."""
        compute = self.next_turn.compute
        if compute is None:
            return MAX_LEAD_S
        seconds = sum(compute.prefill_ms(len(live.conversation.tokens)) for live in self._candidates()) / 1e3
        return min(MAX_LEAD_S, max(MIN_LEAD_S, 2 * seconds / self.lanes))

    async def _ahead_until(self, to_midnight: float) -> None:
        """Passes of prepare_ahead until the midnight `to_midnight` seconds away (or MAX_SLEEP_S, when the clock
        is read again); the pass under way then is stopped (a job that runs is waited for)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(MAX_SLEEP_S, to_midnight + 0.01)
        while (left := deadline - loop.time()) > 0:
            task = asyncio.ensure_future(self.prepare_ahead())
            try:
                done, _ = await asyncio.wait([task], timeout=left)
            finally:
                if not task.done():  # the midnight, or the service stopping
                    task.cancel()
                    await asyncio.wait([task])
            if not done:
                return
            if not task.cancelled() and task.exception() is not None:
                log.error("preparing the next date's turns failed", exc_info=task.exception())
            await asyncio.sleep(min(AHEAD_POLL_S, max(0.0, deadline - loop.time())))

    async def prepare_ahead(self) -> int:
        """One pass before a midnight: each likely conversation's next turn as the template will render it
        after the midnight, prefilled (or extended, after a turn since) on the background lanes, likeliest
        first, while the states held stay within `next_turn.room()`; how many are whole."""
        day = self._today() + timedelta(days=1)
        if self._on_date is None or self._on_date[0] != day:
            self._on_date = (day, self.next_turn.formatter.on_date(day))
        formatter = self._on_date[1]
        if formatter is None:  # a template that reads the date otherwise
            return 0
        # Only the states of conversations no longer held go: a likely one whose return chance dips below the bar
        # for a pass keeps what was computed for it.
        self.next_turn.keep_ahead_only({live.id for live in self._conversations() if not live.deleted})
        waiting = self._candidates()
        counts = await asyncio.gather(*(self._ahead_in_turn(waiting, formatter, day, lane)
                                        for lane in range(self.lanes)))
        return sum(counts)

    async def _ahead_in_turn(self, waiting: list[LiveSession], formatter: ChatFormatter, day: date,
                             lane: int) -> int:
        """Takes the likeliest conversation left in `waiting` and prepares its next date's state on background
        lane `lane`, until none is left; how many are whole. One that fails is logged and left (the other lanes
        go on, and the next pass tries it again)."""
        whole = 0
        while waiting:
            live = waiting.pop(0)
            try:
                whole += await self.next_turn.prepare_ahead(live, formatter, day, lane)
            except Exception:
                log.exception("preparing %s's turn for %s failed", live.id, day)
        return whole

    async def check(self) -> int:
        """If the date changed since the last check: the next turns of the conversations likely to return
        within HORIZON_S (the placement policy's bar for spending CPU on a stored state), likeliest soon first;
        how many were prepared."""
        today = self._today()
        if today == self.date:
            return 0
        self.date = today
        self.next_turn.counters.date_changes += 1
        try:
            candidates = self._candidates()
            # Those prepared before the midnight first: they take a moment, and their users may be back in one.
            waiting = sorted(candidates, key=lambda live: not self.next_turn.is_ready_ahead(live, today))
            counts = await asyncio.gather(*(self._prepare_in_turn(waiting, today, lane)
                                            for lane in range(self.lanes)))
        finally:
            self.next_turn.drop_ahead()
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
            job = asyncio.ensure_future(self.next_turn.prepare(live, from_storage=True, lane=lane, day=today))
            await asyncio.wait([job])
            if job.cancelled():
                continue
            if job.exception() is not None:
                log.error("preparing %s's next turn failed", live.id, exc_info=job.exception())
            elif job.result():
                prepared += 1
                await self._enforce_budget()
        return prepared
