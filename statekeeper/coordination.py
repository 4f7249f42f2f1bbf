"""Replicas that share one history take turns on a conversation one at a time: a per-conversation lease in
Redis, held for a turn and renewed while it runs.

The lease is `SET NX PX` (it expires by itself when the replica holding it dies) and comes with a fencing
token, a per-conversation counter incremented with each lease granted (Kleppmann, "How to do distributed
locking", 2016). The history refuses a commit whose token is older than the newest it committed, and
compares the turn count besides (statekeeper/history/store.py): a replica that stalled past its lease's
expiry cannot commit over the turn of the replica that took the lease over.

Keys, Cluster-safe (both keys of one conversation in one hash slot): `<prefix>{<name>}:lease` holds the
holder's random owner token, `<prefix>{<name>}:fence` the counter, where <name> is a hash of the
conversation id: key names show in SCAN, MONITOR and the slow log, and an id opens its conversation (ids
are 192 random bits, so the hash hides them without a key, and every replica computes the same). The
counter expires an hour after its last grant (a lost counter restarts above every token, see _ACQUIRE),
and a deleted conversation's keys go with it."""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

log = logging.getLogger(__name__)

# Grants the lease and returns its fencing token, or nil while another holds it; one step on the server.
# A counter that Redis lost (a restart without persistence, an eviction) starts again from Redis's clock in
# microseconds, above every token granted before (that would take over a million grants a second), so
# the history never sees a new holder's token as older than a dead one's.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    local fence = redis.call('INCR', KEYS[2])
    if fence == 1 then
        local now = redis.call('TIME')
        fence = tonumber(now[1]) * 1000000 + tonumber(now[2])
        redis.call('SET', KEYS[2], string.format('%.0f', fence))
    end
    redis.call('PEXPIRE', KEYS[2], ARGV[3])
    return fence
end
return false
"""
# Renews or releases the lease only for its holder: one whose lease expired and was granted to another
# must not extend or delete the other's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class CoordinationUnavailable(Exception):
    """Redis cannot be reached: no lease can be granted, so no turn may run."""


@dataclass(frozen=True, slots=True)
class Lease:
    conversation_id: str
    owner: str  # random, one per grant: what renew and release check
    fence: int  # the fencing token the turn's commit carries


class ConversationLeases:
    def __init__(self, url: str, password: str | None = None, key_prefix: str = "statekeeper:", ttl_ms: int = 10_000,
                 wait_seconds: float = 2.0, socket_timeout_s: float = 2.0):
        self.ttl_ms = ttl_ms
        self.wait_seconds = wait_seconds  # how long a turn waits for a lease held elsewhere before a 409
        self._prefix = key_prefix
        # A dropped connection is retried a few times with backoff before a lease call fails.
        self._redis = redis.Redis.from_url(url, password=password, socket_timeout=socket_timeout_s,
                                           socket_connect_timeout=socket_timeout_s,
                                           retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 3),
                                           retry_on_error=[redis.ConnectionError, redis.TimeoutError])
        self._fence_ttl_ms = max(3_600_000, 10 * ttl_ms)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)

    def _keys(self, conversation_id: str) -> list[str]:
        name = hashlib.blake2b(conversation_id.encode(), digest_size=16, person=b"sk-lease-name").hexdigest()
        stem = f"{self._prefix}{{{name}}}"
        return [f"{stem}:lease", f"{stem}:fence"]

    def try_acquire(self, conversation_id: str) -> Lease | None:
        """The lease, or None while another holds it."""
        owner = secrets.token_hex(16)
        try:
            fence = self._acquire(keys=self._keys(conversation_id), args=[owner, self.ttl_ms, self._fence_ttl_ms])
        except redis.RedisError as exc:
            raise CoordinationUnavailable("the lease store (Redis) cannot be reached") from exc
        return None if fence is None else Lease(conversation_id, owner, int(fence))

    def renew(self, lease: Lease) -> bool | None:
        """Extends the lease by its time to live; False if it was lost (expired, maybe granted to another), None
        if Redis could not be reached (it may still hold: try again while it would)."""
        try:
            return bool(self._renew(keys=self._keys(lease.conversation_id)[:1], args=[lease.owner, self.ttl_ms]))
        except redis.RedisError:
            log.warning("renewing the lease on %s failed: Redis cannot be reached", lease.conversation_id)
            return None

    def release(self, lease: Lease) -> None:
        try:
            self._release(keys=self._keys(lease.conversation_id)[:1], args=[lease.owner])
        except redis.RedisError:  # it expires by itself
            log.warning("releasing the lease on %s failed: it expires in %d ms", lease.conversation_id, self.ttl_ms)

    def forget(self, conversation_id: str) -> None:
        """A deleted conversation's keys; what Redis cannot take now expires by itself."""
        try:
            self._redis.delete(*self._keys(conversation_id))
        except redis.RedisError:
            log.warning("the lease keys of a deleted conversation could not be removed: they expire by themselves")

    def close(self) -> None:
        self._redis.close()
