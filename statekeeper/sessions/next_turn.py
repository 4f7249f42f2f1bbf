"""The next turn's state, prepared in background time, for chat templates that render a history otherwise the
next time (a think block dropped, the system prompt moved: ChatFormatter.next_turn). After such a turn the
KV up to where the renderings part is kept, the rest of the next rendering (for a think-dropping template,
only the answer) is prefilled as background work on the model thread, and the conversation's tokens become
that rendering: the next turn is a pure append. A turn that arrives meanwhile takes over (the work stops
between chunks and the KV goes back to the shared part, which that turn keeps); a shared history (replicas)
is left as it is, since only a turn's lease may rewrite it. At a date change (sessions/date_rollover.py) the
same preparation runs for conversations whose KV is stored, from an empty cache."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Callable

from scheduler.plan import ComputeProfile
from scheduler.ranked_turns import RankedTurns
from statekeeper.chat import ChatFormatter, common_prefix_length
from statekeeper.history import HistoryStore
from statekeeper.kv_cache import GaveWay, KVCache
from statekeeper.sessions.executors import Executors
from statekeeper.sessions.kv_restore import KVRestorer
from statekeeper.sessions.live import LiveSession, StoppedPreparation
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)

# A background prefill job holds the model thread about this long at most (by the compute profile measured at
# start), so a user whose turn arrives meanwhile waits about this for it: a whole history recomputed at a date
# change in 512-token jobs held returning users' turns for seconds each on a slow CPU (BENCHMARKS.md, issue 30).
BACKGROUND_JOB_MS = 50.0
# On the long lane a background job holds no decode step, only a short prompt that takes that lane meanwhile, so
# its jobs are longer: ~16-token jobs cost ~5.4 ms a token on an AVX2 AMD EPYC where a many-row GEMM does ~3.3,
# and system-last's next turns were left half prepared when their users came back (BENCHMARKS.md, issue 30).
LONG_LANE_JOB_MS = 200.0
# An early head follows its reply in pieces of at least this many tokens: a job a token would pay a forward's
# fixed cost (the weights read) for each, more than the token's own work on a CPU.
FOLLOW_TOKENS = 16


@dataclasses.dataclass(slots=True)
class NextTurnCounters:
    prepared: int = 0  # conversations whose next turn will only append
    abandoned: int = 0  # stopped for a turn that arrived, or a history that could not be written
    tokens: int = 0  # tokens prefilled in background time
    seconds: float = 0.0  # the model thread's CPU time for them
    date_changes: int = 0  # midnights that changed what the template renders (sessions/date_rollover.py)
    after_date_change: int = 0  # of `prepared`, those prepared at a date change
    early_tokens: int = 0  # of `tokens`, prefilled while the reply was generated (NextTurnState.start_early)
    early_without_room: int = 0  # early heads not begun: the active KV budget had no room for them
    followed_tokens: int = 0  # of `early_tokens`, the reply's own, prefilled as they were sampled
    ahead_tokens: int = 0  # of `tokens`, prefilled before a date change for the day after it (prepare_ahead)
    ready_at_date_change: int = 0  # of `after_date_change`, those whose state was whole before the change
    gave_way: int = 0  # background jobs stopped between two layers for live work on their lane (run again)
    gave_way_seconds: float = 0.0  # of `seconds`, those jobs' (their work is lost)


@dataclasses.dataclass(slots=True)
class EarlyHead:
    """The next turn's rendering up to the reply being generated, then the reply's tokens as they come
    (`tokens`), prefilled into a cache of its own meanwhile; the preparation after the reply takes it up
    (NextTurnState.start_early)."""

    cache: KVCache | None = None  # None until the head is known to need it
    tokens: list[int] = dataclasses.field(default_factory=list)
    conversation: object = None  # the Conversation its turn started from: another one now, the turn is over
    task: asyncio.Task | None = None
    grew: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # the reply has new tokens


@dataclasses.dataclass(slots=True)
class AheadState:
    """A conversation's next turn as the template will render it on `day` (the date after the coming midnight),
    prefilled into a cache of its own before that midnight (NextTurnState.prepare_ahead): at the date change the
    preparation takes it up, as it takes an early head."""

    day: datetime.date
    conversation: object  # the Conversation it was rendered from: another one (a turn since) makes it stale
    cache: KVCache
    tokens: list[int]
    busy: bool = False  # a pass is prefilling it (a job may be appending rows on a model thread)

    @property
    def is_whole(self) -> bool:
        return self.cache.num_tokens == len(self.tokens)


class NextTurnState:
    def __init__(self, worker: ModelWorker, formatter: ChatFormatter, history: HistoryStore, executors: Executors,
                 restorer: KVRestorer, cancel_compression: Callable[[str], None],
                 compute: ComputeProfile | None = None, room: Callable[[], int] | None = None):
        """`cancel_compression(id)`: the stored blob's pending compression, which a state prepared from storage
        makes stale (as a turn does); `compute`: this machine's prefill times, which size the background jobs
        (without it, prefill chunks); `room()`: the bytes of KV the states held here may take now, beside the
        active conversations' (the active KV budget's rest; None: early heads without a bound, and no states
        prepared before a midnight)."""
        self.worker = worker
        self.formatter = formatter
        self.history = history
        self.executors = executors
        self.restorer = restorer
        self._cancel_compression = cancel_compression
        self.compute = compute
        self.room = room
        self.counters = NextTurnCounters()
        # Per background lane, the share of its job length (BACKGROUND_JOB_MS, LONG_LANE_JOB_MS) its next job
        # takes: halved each time a job gives way to live work, doubled back each time one ends, so that where
        # returning users come often the jobs shrink until one fits between them.
        self._job_share = [1.0, 1.0]
        self._lane_turns = [RankedTurns(), RankedTurns()]  # per background lane: whose job goes next
        self._early: dict[str, EarlyHead] = {}  # by conversation id, while its turn's reply is generated
        # By conversation id: heads a preparation took up, stopped, until it uses them; a turn that comes first
        # takes them instead (take_ahead_for_turn), as it takes the rows of a preparation it stops.
        self._taken: dict[str, EarlyHead] = {}
        self._ahead: dict[str, AheadState] = {}  # by conversation id, before a date change
        self._no_plan: dict[str, object] = {}  # id -> the Conversation whose next date's rendering is the same

    def start_early(self, live: LiveSession, new_messages: list[dict], tools: list[dict] | None,
                    options: dict | None) -> asyncio.Task | None:
        """During a turn, once its prompt is in the KV: where the next turn will render this turn's prompt
        otherwise (a template that moves the system prompt before the last user message renders this one's
        without it), the part of that rendering before the reply is prefilled into a cache of its own in
        background jobs while the reply is generated, so that the preparation after the reply has the reply
        left to do. On a slow CPU the first turn's preparation re-prefilled the whole first message after the
        reply and was seldom done when its user came back. Once the head is in, the reply's tokens follow as
        they are sampled, FOLLOW_TOKENS or more at a time (`live.reply`; `reply_grew` wakes it), so that a long
        reply is not left to re-prefill after it either. The task (rendering off the event loop), or None."""
        self._drop_early(live)  # an earlier turn's that its preparation never took up (a turn came first)
        if not self.formatter.moves_earlier_turns or self.history.is_shared or live.cache is None \
                or live.cache.head_bias is not None:
            return None
        early = EarlyHead(conversation=live.conversation)
        messages = live.conversation.chat_messages() + new_messages
        early.task = asyncio.ensure_future(self._prefill_early(early, live.cache, live.prompt, live.reply, messages,
                                                               tools, options, self.executors.last_background_lane))
        self._early[live.id] = early
        return early.task

    def reply_grew(self, live: LiveSession) -> None:
        """The turn under way sampled more of its reply: its early head, if any, follows it."""
        early = self._early.get(live.id)
        if early is not None:
            early.grew.set()

    async def _prefill_early(self, early: EarlyHead, source: KVCache, prompt: list[int], reply: list[int],
                             messages: list[dict], tools, options, lane: int) -> None:
        """Where at least a job's worth of the head (`_follow_tokens`) lies past the parting: the rows before it
        (with the ids of the turn's `prompt`, which its rows hold) are copied (on the model thread, after the step
        that holds them, on its stream on a GPU). Then the rest of the head in background jobs, then the `reply`'s
        tokens as they come, until cancelled (a job that started is waited for: the cache holds `tokens`' first
        rows after it). The reply's tokens are the next rendering's only as far as the template renders them so
        (the preparation keeps what matches). A late parting is worth it too: a row copied costs microseconds,
        a row prefilled milliseconds on a CPU, and past a long history's parting lies the whole last user
        message (once only heads that parted in their first half were begun, and later turns' preparations
        re-prefilled hundreds of tokens after the reply)."""
        plan = await self.executors.in_template_thread(self.formatter.reply_head, messages, tools, options, prompt,
                                                       background=True)
        common = 0 if plan is None else min(plan.common, source.num_tokens)
        if plan is None or len(plan.tokens) - common < self._follow_tokens() or common < source.min_cut:
            return
        if self.room is not None and self.held_bytes() + self._bytes(plan.tokens) > self.room():
            self.counters.early_without_room += 1  # a second copy of the conversation's KV while the reply runs
            return
        cache, tokens = self.worker.new_cache(), list(plan.tokens)
        await self._copy_rows(cache, source, common)
        early.cache, early.tokens = cache, tokens
        while cache.num_tokens < len(tokens):
            self.counters.early_tokens += await self._prefill_job(cache, tokens, None, lane)
        head, least = len(tokens), self._follow_tokens()
        while True:  # the reply, in pieces of at least `least` tokens
            early.grew.clear()
            if len(reply) - (len(tokens) - head) < least:
                await early.grew.wait()
                continue
            tokens.extend(reply[len(tokens) - head :])
            while cache.num_tokens < len(tokens):
                done = await self._prefill_job(cache, tokens, None, lane)
                self.counters.early_tokens += done
                self.counters.followed_tokens += done

    def _follow_tokens(self) -> int:
        """The fewest of the reply's new tokens an early head's job follows: FOLLOW_TOKENS, or a forward's fixed
        cost in tokens' worth where the compute profile says it is more."""
        overhead = 0.0 if self.compute is None else self.compute.step_overhead_tokens
        return max(FOLLOW_TOKENS, math.ceil(overhead))

    async def _copy_rows(self, cache: KVCache, source: KVCache, count: int) -> None:
        """`source`'s first `count` rows appended to the empty `cache`, on the model thread (after the step that
        holds them, on its stream on a GPU), with the cut below which they are not exact (KVCache.min_cut)."""
        cache.min_cut = source.min_cut  # zeros where sliding-window layers' rows fell out
        await self.executors.in_model_thread(lambda: cache.append(source.copy_range(0, count)))

    def _drop_early(self, live: LiveSession, stale_only: bool = False) -> None:
        """`live`'s early head, its jobs stopped; `stale_only`: only one whose turn is over (a turn that runs now
        began none, or its own: a refused request, scoring, a date change's preparation find the head there)."""
        early = self._early.get(live.id)
        if early is not None and (not stale_only or early.conversation is not live.conversation):
            del self._early[live.id]
            early.task.cancel()
            early.task.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved: no warning

    async def _take_early(self, live: LiveSession) -> EarlyHead | None:
        """This conversation's early head, its jobs stopped (one that runs is waited for); None where there is
        none or its work failed."""
        early = self._early.pop(live.id, None)
        if early is None:
            return None
        early.task.cancel()
        await asyncio.wait([early.task])
        if not early.task.cancelled() and early.task.exception() is not None:
            log.warning("the early head of %s failed: %s", live.id, early.task.exception())
            return None
        return early if early.cache is not None else None

    async def prepare_ahead(self, live: LiveSession, formatter: ChatFormatter, day: datetime.date, lane: int
                            ) -> bool:
        """Before a midnight: `live`'s next turn as `formatter` renders it on `day` (ChatFormatter.on_date),
        prefilled in background jobs on `lane` into a cache of its own, the conversation's own state untouched.
        A state already prepared for `day` is extended: after a turn since, from where the renderings part
        (the turn appended its messages to both); from memory the rows before the date are copied. A state is
        begun or grown only while all the states held here stay within `room()` as it is on the call (counted at
        their full length, so two lanes cannot both take the same room). Stops where a turn changed the
        conversation meanwhile (the next call goes on from there). Whether the state is whole for the
        conversation as it is."""
        room_bytes, conversation = self.room(), live.conversation
        ahead = self._ahead.get(live.id)
        if ahead is not None and (ahead.day != day or live.deleted):  # another midnight's, or no one's
            del self._ahead[live.id]
            ahead = None
        if self.history.is_shared or live.deleted or not conversation.tokens:
            return False
        if self.is_ready_ahead(live, day):
            return True
        if self._no_plan.get(live.id) is conversation:
            return False
        plan = await self.executors.in_template_thread(formatter.next_turn, conversation.tokens,
                                                       conversation.chat_messages(), conversation.tools,
                                                       conversation.template_options, background=True)
        if plan is None:  # the date is the client's (chat_template_kwargs), or nothing to prepare
            self._no_plan[live.id] = conversation
            return False
        ahead = self._ahead.get(live.id)  # as it is now, after the rendering
        held = self.held_bytes() - (0 if ahead is None else self._bytes(ahead.tokens))
        if held + self._bytes(plan.tokens) > room_bytes:
            self._ahead.pop(live.id, None)  # what it holds is better spent on the likelier ones before it
            return False
        if ahead is not None and ahead.busy:  # another pass's (one stopped at the deadline) still runs
            return False
        if ahead is not None:
            shared = common_prefix_length(ahead.tokens[: ahead.cache.num_tokens], plan.tokens)
            ahead.cache.truncate(shared)
            ahead.conversation, ahead.tokens = conversation, plan.tokens
        else:
            ahead = self._ahead[live.id] = AheadState(day, conversation, self.worker.new_cache(), plan.tokens)
        ahead.busy = True
        try:
            source = live.cache
            common = 0 if source is None else min(plan.common, source.num_tokens)
            if (not ahead.cache.num_tokens and common and source.head_bias is None and not live.in_turn
                    and common >= source.min_cut):
                await self._copy_rows(ahead.cache, source, common)
            while not ahead.is_whole and live.conversation is conversation and self._ahead.get(live.id) is ahead:
                self.counters.ahead_tokens += await self._prefill_job(ahead.cache, ahead.tokens, None, lane)
        finally:
            ahead.busy = False
        return ahead.is_whole and live.conversation is conversation

    def _bytes(self, tokens: list[int]) -> int:
        return len(tokens) * self.worker.kv_bytes_per_token

    def held_bytes(self) -> int:
        """What the states held here take, counted at their full length: the early heads (as far as their
        tokens are known; those a preparation took up too) and the states prepared before a date change."""
        return (sum(self._bytes(early.tokens) for early in self._early.values())
                + sum(self._bytes(taken.tokens) for taken in self._taken.values())
                + sum(self._bytes(ahead.tokens) for ahead in self._ahead.values()))

    def is_ready_ahead(self, live: LiveSession, day: datetime.date) -> bool:
        ahead = self._ahead.get(live.id)
        return ahead is not None and ahead.day == day and ahead.conversation is live.conversation and ahead.is_whole

    def keep_ahead_only(self, ids: set[str]) -> None:
        """Drops the states prepared before a date change of conversations not in `ids` (no longer held)."""
        for session_id in [session_id for session_id in self._ahead if session_id not in ids]:
            del self._ahead[session_id]

    def drop_ahead(self) -> None:
        """The states prepared before a date change that no preparation took up."""
        self._ahead.clear()
        self._no_plan.clear()

    def take_ahead_for_turn(self, live: LiveSession) -> tuple[KVCache, list[int]] | None:
        """For a turn after a midnight whose conversation the date change's preparation has not reached yet (a
        user back a second after it): the state prepared for the new date before the midnight, whole or in part,
        as a cache and the tokens it holds rows of (the turn keeps it as far as its prompt matches:
        KVRestorer.restore_prefix). None before the midnight, or where there is none. Also for a turn that came
        while the preparation after the last one rendered the next turn: the early head it had taken up."""
        taken = self._taken.pop(live.id, None)  # a head a preparation took up but had not used yet
        if taken is not None and taken.cache.num_tokens:
            return taken.cache, taken.tokens[: taken.cache.num_tokens]
        # The wall clock's date, as the turn's own rendering reads it (strftime_now), not DateRollover's
        # `today`, which its tests move: a state is taken only for the date the prompt is rendered with.
        head, _ = self._take_ahead(live, datetime.date.today())
        return None if head is None else (head.cache, head.tokens[: head.cache.num_tokens])

    def _take_ahead(self, live: LiveSession, day: datetime.date) -> tuple[EarlyHead | None, bool]:
        """`live`'s state prepared for `day` (none before that day, none a pass is prefilling), as a head taken up
        as far as the rendering matches it, and whether it was whole for the conversation as it is."""
        ahead = self._ahead.get(live.id)
        if ahead is None or ahead.busy or ahead.day != day or not ahead.cache.num_tokens:
            return None, False
        del self._ahead[live.id]
        return EarlyHead(ahead.cache, ahead.tokens), ahead.is_whole and ahead.conversation is live.conversation

    async def _prefill_job(self, cache: KVCache, tokens: list[int], stats, lane: int) -> int:
        """One background job: the next piece of `tokens` past what `cache` holds, about BACKGROUND_JOB_MS of
        work on the model thread (lane 0), LONG_LANE_JOB_MS on the long lane (at most a prefill chunk), less
        after jobs that gave way (`_job_share`); counted; how many tokens it prefilled: none where live work
        came to its lane meanwhile (the job stopped between two layers, the cache and `stats` as before it).
        Sent when its turn comes on the lane: the preparation with the fewest tokens left first (RankedTurns)."""
        async with self._lane_turns[lane].turn(len(tokens) - cache.num_tokens):
            return await self._run_prefill_job(cache, tokens, stats, lane)

    async def _run_prefill_job(self, cache: KVCache, tokens: list[int], stats, lane: int) -> int:
        done, chunk, share = cache.num_tokens, self.worker.config.prefill_chunk_tokens, self._job_share[lane]
        budget_ms = (BACKGROUND_JOB_MS if lane == 0 else LONG_LANE_JOB_MS) * share
        least = min(FOLLOW_TOKENS, chunk)
        size = (max(least, int(chunk * share)) if self.compute is None
                else self.compute.chunk_within(done, budget_ms, chunk, least))
        piece = tokens[done : done + size]
        # The shortest job runs to its end: where live work comes more often than a job lasts, one that always
        # gave way would never end, and hold its conversation meanwhile.
        give_way = self.executors.background_lane(lane).live_waiting if size > least else None
        seconds, finished = await self.executors.in_model_thread(self._timed_prefill, cache, piece, stats, give_way,
                                                                 background=True, lane=lane)
        self.counters.seconds += seconds
        if not finished:
            self.counters.gave_way += 1
            self.counters.gave_way_seconds += seconds
            self._job_share[lane] = share / 2
            return 0
        self._job_share[lane] = min(1.0, share * 2)
        self.counters.tokens += len(piece)
        return len(piece)

    async def prepare(self, live: LiveSession, from_storage: bool = False, lane: int | None = None,
                      day: datetime.date | None = None) -> bool:
        """Prepares `live`'s next turn where the template needs it; nothing for an append-only one. Whether it
        prepared one. `from_storage`: a conversation whose KV is not in memory is prepared too, recomputed from
        the start (its stored blob is not read: a date change parts the renderings in the system turn, so it
        would keep next to nothing of it); the stored blob is replaced when the conversation goes idle. `lane`:
        the background lane its jobs run on (Executors.background_lanes); by default the last, the long lane
        where there is one: its core is otherwise idle but for long prompts, so the preparation goes on while
        the model thread runs the other users' turns (on the model thread it waited for a gap in them, and
        a busy spell left it undone when its user came back). `day`: at a date change, the new date, whose state
        prepared before it (prepare_ahead) is taken up. Nothing while a turn runs: its early head is its own, for
        the preparation after it (a date change's, or one a turn's end spawned that ran late, took it away)."""
        if live.in_turn:
            self._drop_early(live, stale_only=True)  # an earlier turn's, whose preparation never came
            return False
        return await self._prepare(live, from_storage, lane, day)

    async def _prepare(self, live: LiveSession, from_storage: bool, lane: int | None,
                       day: datetime.date | None) -> bool:
        conversation = live.conversation
        lane = self.executors.last_background_lane if lane is None else lane
        # Before the lock: a turn that arrives meanwhile must not wait for the head's job in flight. Taken
        # before the first await, so that it is this turn's and not a head a turn that came meanwhile began;
        # until this uses it, a turn that comes takes it (take_ahead_for_turn).
        early, ready = await self._take_early(live), False
        if early is None and day is not None:
            early, ready = self._take_ahead(live, day)
        if early is None:
            return await self._prepare_taken(live, conversation, None, ready, from_storage, lane)
        self._taken[live.id] = early
        try:
            return await self._prepare_taken(live, conversation, early, ready, from_storage, lane)
        finally:
            if self._taken.get(live.id) is early:  # neither a turn took it nor this used it
                del self._taken[live.id]

    async def _prepare_taken(self, live: LiveSession, conversation, early: EarlyHead | None, ready: bool,
                             from_storage: bool, lane: int) -> bool:
        if self.history.is_shared or live.deleted or live.in_turn or live.lock.locked():
            return False
        if live.cache is None and not from_storage or not self.formatter.rewrites_history:
            return False  # (an append-only template's next turn renders nothing to prepare)
        # Off the event loop: a long history's rendering and encoding took 14-315 ms, every other user's wait.
        plan = await self.executors.in_template_thread(self.formatter.next_turn, conversation.tokens,
                                                       conversation.chat_messages(), conversation.tools,
                                                       conversation.template_options, background=True)
        if plan is None:
            return False
        async with live.lock:
            if live.in_turn or live.deleted or live.conversation is not conversation:
                return False
            if early is not None and self._taken.get(live.id) is early:
                del self._taken[live.id]
            else:
                early = None  # a turn took it meanwhile
            stored = live.cache is None
            if stored and not from_storage:
                return False
            keep = 0 if stored else plan.common  # what of the KV both renderings share
            start = keep
            if stored:
                self._cancel_compression(live.id)
                live.cache = self.worker.new_cache()
            if early is not None:  # the head prefilled during the reply or before a midnight, as far as it is the plan's
                shared = common_prefix_length(early.tokens[: early.cache.num_tokens], plan.tokens)
                if shared > keep:
                    early.cache.truncate(shared)
                    live.cache, start = early.cache, shared
            if not await self._prefill(live, plan.tokens, keep, start, lane):
                self._abandon(live, stored, plan.common)
                return False
            updated = dataclasses.replace(conversation, tokens=plan.tokens)
            try:
                await self.executors.in_io_thread(self.history.commit_turn, updated, conversation.turns, live.fence)
            except Exception as exc:  # the history keeps the old tokens: so must the KV
                log.warning("could not store the next turn's tokens of %s: %s", live.id, exc)
                live.cache.truncate(min(keep, live.cache.num_tokens))
                live.stopped_preparation = None
                self._abandon(live, stored)
                return False
            live.conversation = updated
            self.counters.prepared += 1
            self.counters.ready_at_date_change += ready
            return True

    def _abandon(self, live: LiveSession, stored: bool, blob_share: int = 0) -> None:
        """Counts a preparation given up. One that began from storage leaves the KV there again, so the turn
        that took over restores the stored blob instead of an empty cache, unless it had computed more of the
        next rendering than the blob shares with it (`blob_share` tokens): then the turn takes those rows
        (StoppedPreparation). After a date change the blob shares only the tokens before the date, and a state
        prepared before the midnight is most of the way there."""
        self.counters.abandoned += 1
        stopped = live.stopped_preparation
        if stored and (stopped is None or stopped.cache is not live.cache or len(stopped.tokens) <= blob_share):
            live.cache = live.stopped_preparation = None  # the turn restores the blob: nothing of this cache is kept
            self.restorer.reset_stats(live)

    async def _prefill(self, live: LiveSession, tokens: list[int], common: int, start: int, lane: int) -> bool:
        """The KV of `tokens` from `start` (the rows the cache holds of them, at least `common`) on, in background
        jobs (`_prefill_job`); False (the KV back at `common`, what the conversation's tokens share with
        `tokens`) once a turn waits for the conversation."""
        cache = live.cache
        cache.truncate(min(start, cache.num_tokens))
        self.restorer.reset_stats(live)
        live.stored_tokens = None  # what is stored no longer matches what memory holds
        live.preparing = asyncio.current_task()  # a turn that arrives cancels it (TurnRunner.slot)
        try:
            while cache.num_tokens < len(tokens):
                if live.in_turn:
                    self._stop_for_turn(live, tokens, common)
                    return False
                await self._prefill_job(cache, tokens, live.stats, lane)
        except asyncio.CancelledError:  # a turn came: a job in line never ran, one that ran is done
            self._stop_for_turn(live, tokens, common)
            return False
        except Exception:  # a job that failed: the rows past `common` are not the conversation's tokens'
            cache.truncate(min(common, cache.num_tokens))
            raise
        finally:
            live.preparing = None
        return True

    @staticmethod
    def _stop_for_turn(live: LiveSession, tokens: list[int], common: int) -> None:
        """The KV back at `common`, as the conversation's tokens still are; what was computed past it is set
        aside for the turn that stopped the work (StoppedPreparation): on a slow CPU a returning user's turn
        stopped most preparations part way and computed all of it again."""
        cache = live.cache
        computed = cache.num_tokens
        rows = cache.copy_range(common, computed)  # none where nothing was computed past it
        cache.truncate(min(common, computed))
        if rows and cache.num_tokens == common:
            live.stopped_preparation = StoppedPreparation(cache, common, tokens[:computed], rows)

    def _timed_prefill(self, cache, tokens: list[int], stats, give_way) -> tuple[float, bool]:
        """On a model lane: the prefill, the CPU time it took there, and whether it ended (not GaveWay)."""
        started = time.thread_time()
        try:
            self.worker.prefill(cache, tokens, stats, give_way)
        except GaveWay:
            return time.thread_time() - started, False
        return time.thread_time() - started, True

    def report(self) -> dict:
        return dataclasses.asdict(self.counters)
