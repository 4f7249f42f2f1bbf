"""API keys and the tenants they belong to.

A key is `sk-<key id>.<secret>`: the id finds its record, the secret is checked against a SHA-256 digest
(keys carry 192 random bits, so a fast digest is enough) and never stored. Records live in their own LMDB
(`<data dir>/keys.lmdb`), so `statekeeper keys ...` can manage them beside a running service; replicas
that share a PostgreSQL history keep them there (PostgresKeyStore), so a key works on every replica. Every
conversation belongs to one tenant; without API keys (AUTH=none) all belong to DEFAULT_TENANT.

TenantLimits bound what one tenant may hold and take on, so one tenant's load cannot crowd out the rest;
the session service enforces them (429 with Retry-After)."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import lmdb

DEFAULT_TENANT = ""  # the one tenant of a service without API keys
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_KEY = re.compile(r"^sk-([A-Za-z0-9_-]{8})\.([A-Za-z0-9_-]{32})$")


def check_tenant(tenant: str) -> str:
    if not re.fullmatch(TENANT_PATTERN, tenant):  # re.match's "$" let "acme\n" through as another tenant
        raise ValueError("a tenant name is 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
    return tenant


@dataclass(frozen=True, slots=True)
class ApiKey:
    key_id: str
    tenant: str
    created_at: str
    revoked: bool = False


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, path: Path):
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=1 << 30, max_dbs=1)
        self._keys = self._env.open_db(b"keys")

    def create(self, tenant: str) -> tuple[ApiKey, str]:
        """A new key for `tenant`: its record, and the key itself, which is shown once and kept nowhere."""
        return _with_a_free_id(tenant, self._insert)

    def _insert(self, record: ApiKey, digest: str) -> bool:
        with self._env.begin(write=True) as txn:
            return txn.put(record.key_id.encode(), json.dumps(asdict(record) | {"digest": digest}).encode(),
                           db=self._keys, overwrite=False)

    def list(self) -> list[ApiKey]:
        with self._env.begin() as txn:
            records = [json.loads(value) for _, value in txn.cursor(db=self._keys)]
        return [ApiKey(**{name: r[name] for name in ("key_id", "tenant", "created_at", "revoked")}) for r in records]

    def revoke(self, key_id: str) -> bool:
        """Revoked keys stay listed (who had access, and when); False if there is no such key."""
        with self._env.begin(write=True) as txn:
            value = txn.get(key_id.encode(), db=self._keys)
            if value is None:
                return False
            txn.put(key_id.encode(), json.dumps(json.loads(value) | {"revoked": True}).encode(), db=self._keys)
        return True

    def tenant_of(self, key: str) -> str | None:
        """The tenant a key belongs to; None for a key that is malformed, unknown or revoked."""
        match = _KEY.match(key)
        if match is None:
            return None
        with self._env.begin() as txn:
            value = txn.get(match.group(1).encode(), db=self._keys)
        if value is None:
            return None
        record = json.loads(value)
        return record["tenant"] if _is_valid(key, record["revoked"], record["digest"]) else None

    def close(self) -> None:
        self._env.close()


def _with_a_free_id(tenant: str, insert) -> tuple[ApiKey, str]:
    """A new key for `tenant` stored by `insert(record, digest)` (False: its id is taken), drawing another id
    for one taken: key ids carry 32 random bits (8 hex digits, the key format's), so among many keys two draws
    can meet."""
    for _ in range(8):
        record, key, digest = _new_key(tenant)
        if insert(record, digest):
            return record, key
    raise RuntimeError("no free key id in 8 draws")


def _new_key(tenant: str) -> tuple[ApiKey, str, str]:
    """A new key's record, the key itself and its digest."""
    check_tenant(tenant)
    # Hex: an id that began with "-" (1 in 64 of token_urlsafe's) read as an option in `statekeeper keys revoke`.
    key_id, secret = secrets.token_hex(4), secrets.token_urlsafe(24)
    key = f"sk-{key_id}.{secret}"
    return ApiKey(key_id, tenant, datetime.now(timezone.utc).isoformat()), key, _digest(key)


def _is_valid(key: str, revoked: bool, digest: str) -> bool:
    return not revoked and secrets.compare_digest(digest, _digest(key))


class PostgresKeyStore:
    """KeyStore's records in the shared history's database (table api_keys): a key created through any
    replica works on all of them. Raises HistoryUnavailable while the database cannot be reached."""

    def __init__(self, dsn: str, connect_timeout_s: float = 5.0):
        from statekeeper.history.postgres import migrate_schema, open_pool, transaction

        self._pool = open_pool(dsn, 2, connect_timeout_s, "statekeeper-keys")
        self._transaction = lambda: transaction(self._pool)
        with self._transaction() as connection:
            migrate_schema(connection)

    def create(self, tenant: str) -> tuple[ApiKey, str]:
        return _with_a_free_id(tenant, self._insert)

    def _insert(self, record: ApiKey, digest: str) -> bool:
        with self._transaction() as connection:
            return connection.execute(
                "INSERT INTO api_keys (key_id, tenant, created_at, digest) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (key_id) DO NOTHING",
                (record.key_id, record.tenant, record.created_at, digest)).rowcount == 1

    def list(self) -> list[ApiKey]:
        with self._transaction() as connection:
            rows = connection.execute("SELECT key_id, tenant, created_at, revoked FROM api_keys ORDER BY key_id")
            return [ApiKey(*row) for row in rows]

    def revoke(self, key_id: str) -> bool:
        with self._transaction() as connection:
            return connection.execute("UPDATE api_keys SET revoked = true WHERE key_id = %s", (key_id,)).rowcount > 0

    def tenant_of(self, key: str) -> str | None:
        match = _KEY.match(key)
        if match is None:
            return None
        with self._transaction() as connection:
            row = connection.execute("SELECT tenant, revoked, digest FROM api_keys WHERE key_id = %s",
                                     (match.group(1),)).fetchone()
        return row[0] if row is not None and _is_valid(key, row[1], row[2]) else None

    def close(self) -> None:
        self._pool.close()


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """What each tenant may hold and take on; 0 is no limit. The same for every tenant."""

    sessions: int = 0  # conversations stored
    stored_bytes: int = 0  # bytes of KV blobs in the tiers
    requests_per_minute: int = 0  # /v1 requests in any 60 s
    concurrent_turns: int = 0  # turns (and scorings) under way at once

    def __post_init__(self):
        if min(self.sessions, self.stored_bytes, self.requests_per_minute, self.concurrent_turns) < 0:
            raise ValueError("tenant limits are >= 0 (0: no limit)")


class RequestWindow:
    """Requests per tenant in the last minute (a sliding window of their times), thread-safe."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.per_minute = per_minute
        self._clock = clock
        self._times: dict[str, collections.deque] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: str) -> float | None:
        """Counts a request and returns None, or, when the tenant has had `per_minute` in the last minute,
        counts nothing and returns the seconds until one of them leaves the window."""
        if not self.per_minute:
            return None
        now = self._clock()
        with self._lock:
            times = self._expire(tenant, now)
            if len(times) >= self.per_minute:
                return max(0.0, times[0] + self.WINDOW_S - now)
            times.append(now)
        return None

    def count(self, tenant: str) -> int:
        with self._lock:
            return len(self._expire(tenant, self._clock()))

    def _expire(self, tenant: str, now: float) -> collections.deque:
        times = self._times.setdefault(tenant, collections.deque())
        while times and times[0] <= now - self.WINDOW_S:
            times.popleft()
        return times


def retry_after(seconds: float) -> int:
    """Whole seconds for a Retry-After header: never 0 for a wait that has not passed."""
    return max(1, math.ceil(seconds))
