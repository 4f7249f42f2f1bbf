"""Where the conversation history lives: the setting the history package opens its store from."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class HistoryConfig:
    """Where the conversation history lives (statekeeper/history/): LMDB in the data directory (one
    process), or PostgreSQL shared by replicas."""

    backend: str = "lmdb"  # lmdb | postgres
    postgres_dsn: str | None = field(default=None, repr=False)  # may hold a password
    pool_size: int = 8  # connections; the service's I/O and restore threads share them
    connect_timeout_seconds: float = 5.0  # a request waits this long for a connection before a 503

    def __post_init__(self):
        if self.backend not in ("lmdb", "postgres"):
            raise ValueError(f"history backend {self.backend!r}: lmdb or postgres")
        if self.backend == "postgres" and not self.postgres_dsn:
            raise ValueError("the postgres history backend needs a DSN")
        if self.pool_size < 1 or self.connect_timeout_seconds <= 0:
            raise ValueError("pool_size must be >= 1 and connect_timeout_seconds > 0")
