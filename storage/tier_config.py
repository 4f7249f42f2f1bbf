"""The configuration of one tier: owned here, where the tiers are built (storage/factory.py), and filled in
by the layer above (statekeeper/settings.py), which also checks the codec names it knows."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1024 * 1024
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://")  # what redis-py's from_url connects to


def check_redis_url(url: str, what: str) -> None:
    if not url.startswith(REDIS_URL_SCHEMES):
        raise ValueError(f"{what} must start with {', '.join(REDIS_URL_SCHEMES)}")


@dataclass(slots=True)
class TierConfig:
    name: str  # dram | lmdb | ssd | redis
    budget_bytes: int
    path: Path | None = None  # lmdb, ssd
    url: str | None = field(default=None, repr=False)  # redis:// or rediss://, may hold a password
    password: str | None = field(default=None, repr=False)
    key_prefix: str = "statekeeper:"
    ttl_seconds: int | None = None
    chunk_bytes: int = 8 * MiB
    codec: str = "none"  # blobs landing here are re-encoded with this codec if they have more bits
    # redis: the key for blob MACs and key names, shared by every replica on the same Redis (None: the
    # service uses one kept in its data directory, statekeeper/assembly.py)
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.budget_bytes <= 0:
            raise ValueError(f"tier {self.name}: budget must be positive")
        if self.url is not None:
            check_redis_url(self.url, f"tier {self.name}'s url")
