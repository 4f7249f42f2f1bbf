"""Redis tier: the shared tier that lets several replicas restore each other's conversations.

A blob is stored as chunks plus a small meta record, all under one hash tag (`{prefix}{<key>}...`), so a
session's keys land on one Redis Cluster slot. A put writes the chunks of a new generation and then the
meta record in one MULTI/EXEC transaction (a reader sees the old blob or the new one, never a mix) and
drops the previous generation's chunks afterwards. Redis being down never fails a turn: the tier raises
TierUnavailable, marks itself unavailable, and retries the connection with exponential backoff."""

from __future__ import annotations

import json
import logging
import secrets
import time

import redis

from storage.base import Buffer, SizedTier, TierUnavailable

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


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
    ):
        self._client = redis.Redis.from_url(
            url, password=password, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        super().__init__(budget_bytes)
        self._prefix = prefix
        self._ttl = ttl_seconds
        self._chunk = chunk_bytes
        self._available = True
        self._retry_at = 0.0
        self._backoff = 0.5
        try:
            self._call(self._scan)
        except TierUnavailable as exc:
            if isinstance(exc.__cause__, redis.AuthenticationError):
                raise exc.__cause__  # a wrong password is a configuration error: fail at start
            # otherwise start unavailable; the first call after the backoff retries

    # -- availability ------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._available

    def _call(self, fn, *args):
        if not self._available and time.monotonic() < self._retry_at:
            raise TierUnavailable("redis is unavailable")
        try:
            result = fn(*args)
        except _CONNECTION_ERRORS as exc:
            self._mark_down(exc)
            raise TierUnavailable(f"redis: {exc}") from exc
        if not self._available:
            log.info("redis tier is back")
            self._available, self._backoff = True, 0.5
            self._scan()
        return result

    def _mark_down(self, exc: Exception) -> None:
        if self._available:
            log.warning("redis tier unavailable: %s", exc)
        self._available = False
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, 30.0)

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
            meta = self._client.get(meta_key)
            if meta is None:
                continue
            key = meta_key.decode()[len(self._prefix) + 1 : -len("}:meta")]
            sizes[key] = json.loads(meta)["size"]
        with self._accounting:
            self._sizes, self._used = sizes, sum(sizes.values())

    # -- tier interface ----------------------------------------------------------------------------

    def put(self, key: str, blob: Buffer) -> None:
        self._check_room(key, len(blob))
        self._call(self._put, key, memoryview(blob))
        self._record(key, len(blob))

    def _put(self, key: str, blob: memoryview) -> None:
        previous = self._client.get(self._meta_key(key))
        generation = secrets.token_hex(4)
        count = max(1, -(-len(blob) // self._chunk))
        pipe = self._client.pipeline(transaction=True)
        for index in range(count):
            pipe.set(self._chunk_key(key, generation, index), blob[index * self._chunk : (index + 1) * self._chunk].tobytes(),
                     ex=self._ttl)
        meta = json.dumps({"generation": generation, "chunks": count, "size": len(blob)})
        pipe.set(self._meta_key(key), meta, ex=self._ttl)
        pipe.execute()
        if previous is not None:
            self._delete_generation(key, json.loads(previous))

    def _delete_generation(self, key: str, meta: dict) -> None:
        names = [self._chunk_key(key, meta["generation"], i) for i in range(meta["chunks"])]
        if names:
            self._client.delete(*names)

    def get(self, key: str) -> Buffer | None:
        return self._call(self._get, key)

    def _get(self, key: str) -> bytes | None:
        meta = self._client.get(self._meta_key(key))
        if meta is None:
            return None
        meta = json.loads(meta)
        # One GET per chunk: for multi-MB values this measured faster than a pipeline, which buffers
        # every reply before returning (BENCHMARKS.md).
        chunks = []
        for index in range(meta["chunks"]):
            chunk = self._client.get(self._chunk_key(key, meta["generation"], index))
            if chunk is None:
                return None  # expired or replaced mid-read: treated as missing
            chunks.append(chunk)
        blob = b"".join(chunks)
        return blob if len(blob) == meta["size"] else None

    def delete(self, key: str) -> bool:
        self._forget(key)
        return self._call(self._delete, key)

    def _delete(self, key: str) -> bool:
        meta = self._client.get(self._meta_key(key))
        if meta is None:
            return False
        self._client.delete(self._meta_key(key))
        self._delete_generation(key, json.loads(meta))
        return True

    def close(self) -> None:
        self._client.close()
