"""What a session request can fail with; the API maps `status` to the HTTP status."""

from statekeeper.history import HistoryConflict, HistoryUnavailable, is_out_of_space


class SessionError(Exception):
    status = 400


class SessionNotFound(SessionError):
    status = 404


class TurnInProgress(SessionError):
    status = 409


class ContentTooLarge(SessionError):
    status = 413


class ContextOverflow(SessionError):
    status = 400


class InvalidRequest(SessionError):
    status = 422


class Overloaded(SessionError):
    """Too many turns under way: the client should try again after `retry_after_seconds`."""

    status = 429
    retry_after_seconds = 1


class TenantLimitReached(SessionError):
    """One of the tenant's limits (statekeeper.tenancy.TenantLimits) is reached: try again after
    `retry_after_seconds` (sooner if the tenant frees what it holds)."""

    status = 429

    def __init__(self, message: str, retry_after_seconds: int):
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds


class StorageFull(SessionError):
    """The history store has no room (disk, quota or LMDB map full); nothing was written."""

    status = 507


class ConversationBusy(SessionError):
    """Another replica holds the conversation's lease (a turn under way there) past the wait, or moved it on
    while this turn ran (its commit was refused, nothing was written): ask again."""

    status = 409
    retry_after_seconds = 1


class HistoryDown(SessionError):
    """The history store cannot be reached (a database outage); nothing was written. It reconnects by
    itself: ask again."""

    status = 503
    retry_after_seconds = 2


def as_refusal(exc: BaseException) -> BaseException:
    """A history write that failed for room becomes a 507 (nothing was written: the store aborted the
    transaction), one refused by the turn's compare-and-set a 409, an unreachable store a 503; not a 500."""
    if is_out_of_space(exc):
        refusal = StorageFull("the conversation store is out of space: nothing was saved, try again later")
    elif isinstance(exc, HistoryConflict):
        refusal = ConversationBusy(f"{exc}; nothing was saved, try again")
    elif isinstance(exc, HistoryUnavailable):
        refusal = HistoryDown("the conversation store cannot be reached now: nothing was saved, try again later")
    else:
        return exc
    refusal.__cause__ = exc
    return refusal
