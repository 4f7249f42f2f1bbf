"""Redis tier: the shared tier that lets several replicas restore each other's conversations.

A blob is stored as chunks plus a small meta record, all under one hash tag (`{prefix}{<key>}...`), so a
session's keys land on one Redis Cluster slot. A put writes the chunks of a new generation and then the
meta record in one MULTI/EXEC transaction (a reader sees the old blob or the new one, never a mix) and
drops the previous generation's chunks afterwards.

Redis being down never fails a turn. redis-py's own `Retry` covers a blip (a pooled connection that died
with a restarted server is retried on a fresh one) and its health check pings a connection idle for
`health_check_interval`; a command that still fails marks the tier unavailable and raises
TierUnavailable, and from then on calls are refused at once while a background thread reconnects with
exponential backoff (0.5 s doubling to 30 s) and re-reads the tier's contents before it is used again.
A Redis that is down at start-up is reconnected the same way. Whatever Redis answers, a caller sees
TierUnavailable or a missing blob, never a raw redis error: anyone who can write to a shared Redis can
put any value under these keys."""

from __future__ import annotations

import json
import logging
import secrets
import threading

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from storage.base import Buffer, SizedTier, TierUnavailable

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_REDIS_ERRORS = (redis.RedisError, OSError)
# ExponentialBackoff.compute(n) = min(cap, base * 2**n): 0.5 s after the first failure, doubling to 30 s.
_RECONNECT_BACKOFF = ExponentialBackoff(cap=30.0, base=0.25)


class _Closed(Exception):
    """Ends the reconnect thread of a closed tier."""


class RedisTier(SizedTier):
    name = "redis"
    is_shared = True

    def __init__(
        self,
        url: str,
        budget_bytes: int,
        prefix: str = "statekeeper:",
        ttl_seconds: int | None = None,
        chunk_bytes: int = 8 << 20,
        password: str | None = None,
        socket_timeout: float = 5.0,
        health_check_interval: int = 30,
    ):
        self._client = redis.Redis.from_url(
            url, password=password, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout,
            # Two quick retries on a fresh connection, only for a dropped connection: a timeout means a hung
            # server, and waiting for it again would only hold the request longer.
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.025), retries=2, supported_errors=(redis.ConnectionError,)),
            health_check_interval=health_check_interval,
        )
        super().__init__(budget_bytes)
        self._prefix = prefix
        self._ttl = ttl_seconds
        self._chunk = chunk_bytes
        self._available = False
        self._state = threading.Lock()  # one reconnect thread at a time
        self._reconnector: threading.Thread | None = None
        self._closed = threading.Event()
        try:
            self._reconnect_once()
        except redis.AuthenticationError:
            raise  # a wrong password is a configuration error: fail at start
        except _REDIS_ERRORS as exc:
            self._mark_down(exc)

    # -- availability ------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._available

    def _call(self, fn, *args):
        if not self._available:
            raise TierUnavailable("redis is unavailable (reconnecting in the background)")
        try:
            return fn(*args)
        except _CONNECTION_ERRORS as exc:  # after redis-py's own retries
            self._mark_down(exc)
            raise TierUnavailable(f"redis: {type(exc).__name__}") from exc
        except redis.RedisError as exc:  # a command Redis refused (out of memory, read-only): this call only
            raise TierUnavailable(f"redis refused the command: {type(exc).__name__}") from exc

    def _mark_down(self, exc: Exception) -> None:
        with self._state:
            if self._closed.is_set() or (not self._available and self._reconnecting()):
                return
            self._available = False
            log.warning("redis tier unavailable (%s): reconnecting in the background", exc)
            self._reconnector = threading.Thread(target=self._reconnect, name="statekeeper-redis-reconnect",
                                                 daemon=True)
            self._reconnector.start()

    def _reconnecting(self) -> bool:
        return self._reconnector is not None and self._reconnector.is_alive()

    def _reconnect(self) -> None:
        # Any failure retries (a thread that died would leave the tier refused for good); only close ends it.
        retry = Retry(_RECONNECT_BACKOFF, retries=-1, supported_errors=(Exception,))
        try:
            retry.call_with_retry(self._reconnect_once, lambda error: log.debug("redis still down: %s", error),
                                  is_retryable=lambda error: not isinstance(error, _Closed))
        except _Closed:
            return
        log.info("redis tier is back")

    def _reconnect_once(self) -> None:
        """Reads the tier's contents (other replicas and the TTL changed them meanwhile), then opens it."""
        if self._closed.is_set():
            raise _Closed
        self._client.ping()
        self._scan()
        self._available = True

    def ping(self) -> bool:
        try:
            return bool(self._call(self._client.ping))
        except TierUnavailable:
            return False

    # -- keys --------------------------------------------------------------------------------------

    def _meta_key(self, key: str) -> str:
        return f"{self._prefix}{{{key}}}:meta"

    def _chunk_key(self, key: str, generation: str, index: int) -> str:
        return f"{self._prefix}{{{key}}}:{generation}:{index}"

    def _scan(self) -> None:
        sizes = {}
        for meta_key in self._client.scan_iter(match=f"{self._prefix}{{*}}:meta", count=1000):
            meta = self._parse_meta(self._get_string(meta_key))
            if meta is not None:
                key = meta_key.decode(errors="replace")[len(self._prefix) + 1 : -len("}:meta")]
                sizes[key] = meta["size"]
        with self._accounting:
            self._sizes, self._used = sizes, sum(sizes.values())

    def _get_string(self, name: str | bytes) -> bytes | None:
        """GET that reads a key of another type (a value someone else put there) as missing."""
        try:
            return self._client.get(name)
        except redis.ResponseError:
            return None

    def _read_meta(self, key: str) -> dict | None:
        return self._parse_meta(self._get_string(self._meta_key(key)))

    def _parse_meta(self, raw: bytes | None) -> dict | None:
        """The meta record if it is one this tier could have written, else None: its size within the budget
        and its chunk count what that size makes in chunks of this tier's size, so a forged record cannot
        make a read or a delete loop or allocate without end (a blob written with another REDIS_CHUNK_MB
        reads as missing and is recomputed)."""
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            generation, chunks, size = meta["generation"], meta["chunks"], meta["size"]
        except (ValueError, TypeError, KeyError):
            return None
        is_valid = (isinstance(generation, str) and generation.isalnum() and len(generation) <= 16
                    and type(size) is int and 0 <= size <= self._budget and chunks == self._num_chunks(size))
        return meta if is_valid else None

    # -- tier interface ----------------------------------------------------------------------------

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        self._call(self._put, key, memoryview(blob))
        self._record(key, len(blob))

    def _put(self, key: str, blob: memoryview) -> None:
        previous = self._read_meta(key)
        generation = secrets.token_hex(4)
        count = self._num_chunks(len(blob))
        pipe = self._client.pipeline(transaction=True)
        for index in range(count):
            pipe.set(self._chunk_key(key, generation, index), blob[index * self._chunk : (index + 1) * self._chunk].tobytes(),
                     ex=self._ttl)
        meta = json.dumps({"generation": generation, "chunks": count, "size": len(blob)})
        pipe.set(self._meta_key(key), meta, ex=self._ttl)
        pipe.execute()
        if previous is not None:
            self._delete_generation(key, previous)

    def _num_chunks(self, size: int) -> int:
        return max(1, -(-size // self._chunk))

    def _delete_generation(self, key: str, meta: dict) -> None:
        names = [self._chunk_key(key, meta["generation"], i) for i in range(meta["chunks"])]
        for start in range(0, len(names), 1000):  # a big blob of small chunks: bounded DEL commands
            self._client.delete(*names[start : start + 1000])

    def get(self, key: str) -> Buffer | None:
        return self._call(self._get, key)

    def _get(self, key: str) -> bytes | None:
        meta = self._read_meta(key)
        if meta is None:
            return None
        # One GET per chunk: for multi-MB values this measured faster than a pipeline, which buffers
        # every reply before returning (BENCHMARKS.md).
        chunks, received = [], 0
        for index in range(meta["chunks"]):
            chunk = self._get_string(self._chunk_key(key, meta["generation"], index))
            if chunk is None:
                return None  # expired or replaced mid-read: treated as missing
            received += len(chunk)
            if received > meta["size"]:
                return None  # not what the meta record says: not this tier's blob
            chunks.append(chunk)
        blob = b"".join(chunks)
        return blob if len(blob) == meta["size"] else None

    def delete(self, key: str) -> bool:
        self._forget(key)
        return self._call(self._delete, key)

    def _delete(self, key: str) -> bool:
        meta = self._read_meta(key)
        found = bool(self._client.delete(self._meta_key(key)))
        if meta is not None:
            self._delete_generation(key, meta)
        return found

    def close(self) -> None:
        self._closed.set()
        self._client.close()
