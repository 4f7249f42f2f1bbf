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

import hashlib
import hmac
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import Iterable

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from storage.tier import BlobRejected, Buffer, SizedTier, TierFull, TierUnavailable

log = logging.getLogger(__name__)

_CONNECTION_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
_REDIS_ERRORS = (redis.RedisError, OSError)
# ExponentialBackoff.compute(n) = min(cap, base * 2**n): 0.5 s after the first failure, doubling to 30 s.
_RECONNECT_BACKOFF = ExponentialBackoff(cap=30.0, base=0.25)
SCAN_BATCH = 1_000  # meta records read in one round trip by a look at what the tier holds
USAGE_REFRESH_S = 1.0  # the least time between two reads of what the shared tier holds (refresh_usage)


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
        secret: bytes | None = None,
    ):
        """`secret`: the key for blob MACs and key names, the same on every replica that shares this Redis
        (None: a random one, good for this process only)."""
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
        self._secret = secret or secrets.token_bytes(32)
        self._keys_by_tag: dict[str, str] = {}  # names hide keys: the keys this process knows, by name
        self._scanned_at = float("-inf")  # when _scan last read what the tier holds
        # While a scan runs: the sizes this process recorded and the names it forgot meanwhile, which the scan's
        # look (taken before them) must not undo
        self._recorded_in_scan: dict[str, int] | None = None
        self._forgotten_in_scan: set[str] = set()
        self._scanning = threading.Lock()
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
        except redis.OutOfMemoryError as exc:  # at maxmemory under noeviction: nothing was written
            raise TierFull("redis: at its maxmemory") from exc
        except redis.RedisError as exc:  # a command Redis refused (read-only, ...): this call only
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

    # -- keys and authentication ---------------------------------------------------------------------

    def _tag(self, key: str) -> str:
        """The key's name in Redis: a keyed hash, so names (SCAN, MONITOR, slow log) reveal no session id."""
        return hashlib.blake2b(key.encode(), key=self._secret, digest_size=16, person=b"sk-redis-name").hexdigest()

    def _mac(self, key: str, blob: Buffer) -> str:
        """Keyed BLAKE2b over the key and the bytes: a blob forged without the secret, or another key's
        blob copied here, does not verify."""
        mac = hashlib.blake2b(key=self._secret, digest_size=32, person=b"sk-redis-blob")
        encoded = key.encode()
        mac.update(len(encoded).to_bytes(2, "little") + encoded)
        mac.update(blob)
        return mac.hexdigest()

    def _meta_key(self, tag: str) -> str:
        return f"{self._prefix}{{{tag}}}:meta"

    def _chunk_key(self, tag: str, generation: str, index: int) -> str:
        return f"{self._prefix}{{{tag}}}:{generation}:{index}"

    def recognize(self, keys: Iterable[str]) -> None:
        with self._accounting:
            self._keys_by_tag.update((self._tag(key), key) for key in keys)

    def contains(self, key: str) -> bool:
        return self._tag(key) in self._sizes

    def keys(self) -> dict[str, int]:
        with self._accounting:
            return {key: self._sizes[tag] for tag, key in self._keys_by_tag.items() if tag in self._sizes}

    def _record(self, tag: str, size: int) -> None:
        with self._accounting:  # one step with the scan's: a look that ends between the two would undo it
            if self._recorded_in_scan is not None:
                self._recorded_in_scan[tag] = size
                self._forgotten_in_scan.discard(tag)
            super()._record(tag, size)

    def _forget(self, tag: str) -> int | None:
        with self._accounting:
            self._keys_by_tag.pop(tag, None)  # else every key ever stored stayed in the table
            if self._recorded_in_scan is not None:
                self._recorded_in_scan.pop(tag, None)
                self._forgotten_in_scan.add(tag)
            return super()._forget(tag)

    def holds_which(self, keys: list[str]) -> set[str]:
        """Of `keys`, those whose meta records Redis holds, by the scan's rule, read in pipelines of SCAN_BATCH."""
        return self._call(self._holding, keys)

    def _holding(self, keys: list[str]) -> set[str]:
        held = set()
        for start in range(0, len(keys), SCAN_BATCH):
            batch = keys[start : start + SCAN_BATCH]
            metas = self._metas([self._meta_key(self._tag(key)) for key in batch])
            held.update(key for key, meta in zip(batch, metas) if meta is not None)
        return held

    def _metas(self, names: list) -> list[dict | None]:
        """The meta records under `names`, read in one round trip (_parse_meta's; None for a missing one, or a key
        of another type)."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.get(name)
        return [self._parse_meta(raw if isinstance(raw, bytes) else None) for raw in pipe.execute(raise_on_error=False)]

    def refresh_usage(self) -> None:
        """At most every USAGE_REFRESH_S (a SCAN and a GET a blob): without it, blobs other replicas deleted
        or the TTL expired stayed in this replica's usage, and every put evicted this replica's own blobs."""
        if time.monotonic() - self._scanned_at >= USAGE_REFRESH_S:
            self._call(self._scan)

    def _scan(self) -> None:
        if not self._scanning.acquire(blocking=False):
            return  # a look is under way (a long one on a large tier): one at a time, its result serves both
        try:
            self._scanned_at = time.monotonic()
            with self._accounting:
                self._recorded_in_scan, self._forgotten_in_scan = {}, set()
            sizes = None
            try:
                sizes = self._sizes_held()
            finally:
                with self._accounting:  # what was written meanwhile merged in the step that ends the look
                    recorded, forgotten = self._recorded_in_scan, self._forgotten_in_scan
                    self._recorded_in_scan, self._forgotten_in_scan = None, set()
                    if sizes is not None:
                        sizes = {tag: size for tag, size in sizes.items() if tag not in forgotten} | recorded
                        self._sizes, self._used = sizes, sum(sizes.values())
                        self._keys_by_tag = {tag: key for tag, key in self._keys_by_tag.items() if tag in sizes}
        finally:
            self._scanning.release()

    def _sizes_held(self) -> dict[str, int]:
        """Every blob's size the tier's meta records hold, by name: their GETs pipelined a thousand at a time (one
        round trip each made a look at 100k blobs take tens of seconds)."""
        sizes, names = {}, self._client.scan_iter(match=f"{self._prefix}{{*}}:meta", count=SCAN_BATCH)
        while batch := list(itertools.islice(names, SCAN_BATCH)):
            for name, meta in zip(batch, self._metas(batch)):
                if meta is not None:
                    sizes[name.decode(errors="replace")[len(self._prefix) + 1 : -len("}:meta")]] = meta["size"]
        return sizes

    def _get_string(self, name: str | bytes) -> bytes | None:
        """GET that reads a key of another type (a value someone else put there) as missing."""
        try:
            return self._client.get(name)
        except redis.ResponseError:
            return None

    def _read_meta(self, tag: str) -> dict | None:
        return self._parse_meta(self._get_string(self._meta_key(tag)))

    def _parse_meta(self, raw: bytes | None) -> dict | None:
        """The meta record if it is one this tier could have written, else None: its size within the budget
        and its chunk count what that size makes in chunks of this tier's size, so a forged record cannot
        make a read or a delete loop or allocate without end (a blob written with another REDIS_CHUNK_MB
        reads as missing and is recomputed)."""
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            generation, chunks, size, mac = meta["generation"], meta["chunks"], meta["size"], meta["mac"]
        except (ValueError, TypeError, KeyError):
            return None
        is_valid = (isinstance(generation, str) and generation.isalnum() and len(generation) <= 16
                    and isinstance(mac, str) and type(size) is int and 0 <= size <= self._budget
                    and type(chunks) is int and chunks == self._num_chunks(size))  # 1.0 == 1, not a range()
        return meta if is_valid else None

    # -- tier interface ----------------------------------------------------------------------------

    def put(self, key: str, blob: Buffer) -> None:
        tag = self._tag(key)
        self._check_room(tag, len(blob))
        self._call(self._put, key, tag, memoryview(blob))
        with self._accounting:
            self._keys_by_tag[tag] = key
        self._record(tag, len(blob))

    def _put(self, key: str, tag: str, blob: memoryview) -> None:
        generation = secrets.token_hex(4)
        count = self._num_chunks(len(blob))
        meta = json.dumps({"generation": generation, "chunks": count, "size": len(blob), "mac": self._mac(key, blob)})
        try:
            previous = self._write_generation(tag, generation, blob, meta)
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            self._client.delete(self._meta_key(tag))  # not a record of this tier's (a list, a hash): replaced
            previous = self._write_generation(tag, generation, blob, meta)
        if previous is not None:
            self._delete_generation(tag, previous)

    def _write_generation(self, tag: str, generation: str, blob: memoryview, meta: str) -> dict | None:
        """Writes the blob's chunks and its meta record in one transaction; the record it replaced. Read in the
        same transaction: two puts of one key at once (two replicas) each delete the generation they replaced,
        where each read the record before and both deleted the same one, the other's chunks left for good."""
        count = self._num_chunks(len(blob))
        pipe = self._client.pipeline(transaction=True)
        for index in range(count):
            pipe.set(self._chunk_key(tag, generation, index), blob[index * self._chunk : (index + 1) * self._chunk].tobytes(),
                     ex=self._ttl)
        pipe.set(self._meta_key(tag), meta, ex=self._ttl, get=True)  # SET ... GET: Redis 6.2 or later
        try:
            return self._parse_meta(pipe.execute()[-1])
        except redis.ResponseError:
            # A command refused at EXEC leaves the others done: chunks no record names would stay for good
            self._delete_generation(tag, {"generation": generation, "chunks": count})
            raise

    def _num_chunks(self, size: int) -> int:
        return max(1, -(-size // self._chunk))

    def _delete_generation(self, tag: str, meta: dict) -> None:
        names = [self._chunk_key(tag, meta["generation"], i) for i in range(meta["chunks"])]
        for start in range(0, len(names), 1000):  # a big blob of small chunks: bounded DEL commands
            self._client.delete(*names[start : start + 1000])

    def get(self, key: str) -> Buffer | None:
        tag = self._tag(key)
        blob = self._call(self._get, key, tag)
        if blob is None:  # expired, evicted by Redis (maxmemory), or deleted by another replica
            self._forget(tag)
        return blob

    def _get(self, key: str, tag: str) -> bytes | None:
        meta = self._read_meta(tag)
        if meta is None:
            return None
        # One GET per chunk: for multi-MB values this measured faster than a pipeline, which buffers
        # every reply before returning (BENCHMARKS.md).
        chunks, received = [], 0
        for index in range(meta["chunks"]):
            chunk = self._get_string(self._chunk_key(tag, meta["generation"], index))
            if chunk is None:
                return None  # expired or replaced mid-read: treated as missing
            received += len(chunk)
            if received > meta["size"]:
                return None  # not what the meta record says: not this tier's blob
            chunks.append(chunk)
        blob = b"".join(chunks)
        if len(blob) != meta["size"]:
            return None
        if not hmac.compare_digest(self._mac(key, blob), meta["mac"]):
            raise BlobRejected("redis: the blob stored for a key does not carry this service's MAC")
        return blob

    def delete(self, key: str) -> bool:
        tag = self._tag(key)
        self._forget(tag)
        return self._call(self._delete, tag)

    def _delete(self, tag: str) -> bool:
        """The record and the generation it names, taken in one step (GETDEL): a put at once deleted the record
        it had just written and its chunks stayed for good."""
        try:
            raw = self._client.getdel(self._meta_key(tag))
        except redis.ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            return bool(self._client.delete(self._meta_key(tag)))  # not a record of this tier's
        meta = self._parse_meta(raw)
        if meta is not None:
            self._delete_generation(tag, meta)
        return raw is not None

    def close(self) -> None:
        self._closed.set()
        self._client.close()
