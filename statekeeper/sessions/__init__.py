"""Conversations and their KV: lifecycle (service.py), one turn's token loop (turns.py), going inactive
and compressing later (offload.py), stored blob back to a cache (restore.py)."""

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
