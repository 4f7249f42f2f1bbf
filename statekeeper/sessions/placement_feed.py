"""What a conversation's turns tell the placement policy (statekeeper/placement/: when its user came back, how
long it is, that it was deleted) and, when TRACE_FILE is set, the trace of the service's own traffic."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from statekeeper.history import Conversation
from statekeeper.placement.policy import LruPlacement, ValuePolicy
from statekeeper.placement.retention import Retention
from statekeeper.placement.trace import TraceTurn, TraceWriter, tag

RECENT_TURNS = 20_000  # kept in memory for the dashboard's forecast (sessions/readouts.py)


class PlacementFeed:
    def __init__(self, policy: LruPlacement | ValuePolicy, retention_of: Callable[[Conversation], Retention],
                 trace_file: Path | None = None):
        """`retention_of(conversation)`: the retention that applies to it (the session service's)."""
        self.policy = policy
        self.retention_of = retention_of
        self.trace = TraceWriter(trace_file) if trace_file is not None else None
        self.recent: deque[TraceTurn] = deque(maxlen=RECENT_TURNS)  # the last turns, as a trace

    def turn_started(self, session_id: str) -> None:
        self.policy.turn_started(session_id)

    def turn_ended(self, conversation: Conversation, started_at: float, new_tokens: int, reply_tokens: int) -> None:
        """`conversation` as committed; `started_at` the turn's Unix time; `new_tokens` what the turn's prompt
        added to the history (the new messages and their template's tokens)."""
        retention = self.retention_of(conversation)
        self.policy.went_idle(conversation.id, conversation.tenant, conversation.turns, len(conversation.tokens),
                              pinned=retention.pinned, priority=retention.weight, ttl_s=retention.ttl_seconds)
        duration_s = time.time() - started_at
        self.recent.append(TraceTurn(started_at, tag(conversation.id), max(1, new_tokens), reply_tokens,
                                     tag(conversation.tenant), duration_s))
        if self.trace is not None:
            self.trace.turn(started_at, conversation.id, conversation.tenant, new_tokens, reply_tokens, duration_s)

    def deleted(self, session_id: str) -> None:
        self.policy.forget(session_id)

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()
