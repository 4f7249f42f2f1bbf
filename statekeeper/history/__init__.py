"""The conversation history, the source of truth, behind one interface (base.py): LMDB embedded (lmdb.py,
the default) or PostgreSQL shared by replicas (postgres.py, imported only when chosen)."""

from __future__ import annotations

from pathlib import Path

from statekeeper.history.config import HistoryConfig
from statekeeper.history.store import Conversation, HistoryConflict, HistoryStore, HistoryUnavailable, StoredResponse
from statekeeper.history.lmdb import LmdbHistory, is_out_of_space as _lmdb_out_of_space

__all__ = ["Conversation", "HistoryConfig", "HistoryConflict", "HistoryStore", "HistoryUnavailable", "LmdbHistory", "StoredResponse",
           "is_out_of_space", "open_history"]


def open_history(config: HistoryConfig, lmdb_path: Path, index_key: bytes) -> HistoryStore:
    """The store `config` names; an LMDB one at `lmdb_path`."""
    if config.backend == "postgres":
        from statekeeper.history.postgres import PostgresHistory

        return PostgresHistory(config.postgres_dsn, index_key=index_key, pool_size=config.pool_size,
                               connect_timeout_s=config.connect_timeout_seconds)
    return LmdbHistory(lmdb_path, index_key=index_key)


def is_out_of_space(exc: BaseException) -> bool:
    """Whether a failed write failed for room (nothing was written): LMDB's map or the disk under it, or
    PostgreSQL's disk."""
    if _lmdb_out_of_space(exc):
        return True
    return type(exc).__name__ == "DiskFull" and type(exc).__module__.startswith("psycopg")
