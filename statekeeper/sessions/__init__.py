"""Conversations and their KV: the front class (service.py) and its parts, one role each (its docstring
lists them); one turn's token loop (turns.py), stored blob back to a cache (restore.py)."""

from statekeeper.sessions.errors import (ContentTooLarge, ContextOverflow, InvalidRequest, Overloaded,
                                         SessionError, SessionNotFound, StorageFull, TenantLimitReached,
                                         TurnInProgress)
from statekeeper.sessions.live import LiveSession, SessionView
from statekeeper.sessions.service import SessionService
from statekeeper.sessions.turns import ScoreResult, TokenScore, TurnDelta, TurnRequest, TurnResult

__all__ = ["ContentTooLarge", "ContextOverflow", "InvalidRequest", "LiveSession", "Overloaded", "ScoreResult",
           "SessionError",
           "SessionNotFound", "SessionService", "SessionView", "StorageFull", "TenantLimitReached", "TokenScore", "TurnDelta", "TurnInProgress",
           "TurnRequest", "TurnResult"]
