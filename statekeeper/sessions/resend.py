"""For a client that resends its whole conversation each turn (OpenAI's chat completions): which stored
conversation it continues, found by its messages (the history's index, statekeeper/prefix_index.py), and what
it adds; a new conversation otherwise, marked to branch from another whose later turns the client edited or
dropped."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from statekeeper.history import Conversation, HistoryStore
from statekeeper.sessions.executors import to_the_end
from statekeeper.sessions.errors import ConversationBusy, SessionNotFound, TurnInProgress
from statekeeper.sessions.live import LiveSession
from statekeeper.sessions.registry import SessionRegistry
from statekeeper.sessions.replicas import ReplicaSync
from statekeeper.sessions.turns import TurnDelta, TurnRequest, TurnResult

Events = AsyncIterator[TurnDelta | TurnResult]


class ResendMatcher:
    def __init__(self, history: HistoryStore, sessions: SessionRegistry, replicas: ReplicaSync,
                 create: Callable[[str | None, str], Awaitable[Conversation]], in_io_thread: Callable[..., Awaitable],
                 turn: Callable[[str, TurnRequest, str], Events], delete: Callable[[str, str], Awaitable[None]]):
        """`create(system, tenant)`: a new conversation found by its messages; `turn(id, request, tenant)` and
        `delete(id, tenant)`: the session service's."""
        self.history = history
        self.sessions = sessions
        self.replicas = replicas
        self._create = create
        self._in_io_thread = in_io_thread
        self._turn = turn
        self._delete = delete

    async def chat(self, messages: list[dict], request: TurnRequest, tenant: str, hint: str | None
                   ) -> tuple[str, TurnDelta | TurnResult, Events]:
        """The turn `messages` ask for (`request` without its content, which is the last message's) on the
        conversation they continue: its id, the turn's first event and the rest of them. A conversation
        created here whose turn does not end in its result (refused, the client gone mid-stream, the save
        failed) is deleted again: its client never learnt its id, and nothing would find it."""
        passed_over: set[str] = set()
        while True:
            session_id, new, is_new = await self.resume_point(messages, tenant, hint, passed_over)
            events = self._turn(session_id, dataclasses.replace(
                request, content=new[-1]["content"], preceding=tuple(new[:-1]), message=new[-1],
                continues=None if is_new else len(messages) - len(new)), tenant)
            if is_new:
                events = self._deleted_unless_answered(events, session_id, tenant)
            try:
                return session_id, await anext(events), events
            except (TurnInProgress, ConversationBusy):
                if passed_over or is_new:
                    raise
                # Another request took the conversation between the lookup and the turn (here, or on another
                # replica, which may have moved it on): the request continues another, or branches.
                passed_over.add(session_id)

    async def _deleted_unless_answered(self, events: Events, session_id: str, tenant: str) -> Events:
        answered = False
        try:
            async for event in events:
                answered = isinstance(event, TurnResult)
                yield event
        finally:
            await to_the_end(self._let_go(events, answered, session_id, tenant))

    async def _let_go(self, events: Events, answered: bool, session_id: str, tenant: str) -> None:
        await events.aclose()  # the turn lets go of the conversation first
        if not answered and not await self._has_a_turn(session_id):  # one its client saw streamed is kept
            await self._delete(session_id, tenant)

    async def _has_a_turn(self, session_id: str) -> bool:
        """Whether the history holds a turn of it: a turn that committed before its client left (the stream
        had the reply; a resend of it finds the conversation again)."""
        conversation = await self._in_io_thread(self.history.load, session_id)
        return conversation is not None and conversation.turns > 0

    async def _get_live(self, session_id: str, tenant: str) -> LiveSession:
        return await self.sessions.get(session_id, tenant)

    async def resume_point(self, messages: list[dict], tenant: str, hint: str | None = None,
                           passed_over: set[str] = frozenset()) -> tuple[str, list[dict], bool]:
        """For a client that resends its whole conversation (`messages`, the new user message last): the
        stored conversation whose history is the longest prefix of `messages` (compared message by
        message), and the messages it does not hold yet; without one, a new conversation (the first
        message its system prompt, if a system message) and every message. The third value says whether
        the conversation is new. `hint` names a conversation to try first, also one of /v1/sessions
        (found by id only). A conversation that is in a turn is passed over: two clients that sent the
        same history at once must not both extend it; so is one in `passed_over`."""
        history = messages[:-1]
        candidates = await self._in_io_thread(self.history.find_heads, history, tenant)
        if hint is not None:
            candidates.insert(0, (hint, None))
        for session_id, length in candidates:
            if session_id in passed_over:
                continue
            try:
                live = await self._get_live(session_id, tenant)
                await self.replicas.follow(live)  # another replica may have moved it on, or deleted it
            except SessionNotFound:
                continue
            held = live.conversation.chat_messages()
            if not (live.in_turn or live.deleted) and length in (None, len(held)) and history[:len(held)] == held:
                return session_id, messages[len(held):], False
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        # Looked up before the conversation is made: made first, a lookup that failed left it for good
        sources, _ = await self._in_io_thread(self.history.find_branch, history, tenant)
        conversation = await self._create(system, tenant)
        live = self.sessions.held(conversation.id)  # None where the idle limits let go of it at once
        if sources and live is not None:  # the client edited or dropped a later turn of another conversation
            live.branch_source = sources[0]
        return conversation.id, messages[1:] if system is not None else messages, True

