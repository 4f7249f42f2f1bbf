"""Tier manager: ordered tiers with byte budgets, demotion under pressure, promotion on request, a
durable index, and per-tier counters. Plain Python, no torch.

Policy (README "Storage tiers"): a new blob lands in the fastest available tier it fits in; to make
room, the policy's victims (LRU) move one tier down; the last tier evicts (the conversation history
stays, so an evicted state is recomputed). Order of writes: the new copy is durable, then the index
points at it, then the old copy is removed — a crash in between leaves two copies, never none, and the
start-up reconciliation keeps the one the index names.

A tier may have a transcoder (bytes in, bytes out; statekeeper/compression/transcode.py re-encodes a
blob with the tier's codec): every blob that lands in that tier, new or demoted, passes through it
first, so colder tiers can hold smaller blobs. A transcoder that fails leaves the blob as it was."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass

from storage.tier import Buffer, Tier, TierFull, TierUnavailable
from storage.index import MemoryTierIndex
from storage.policy import EvictionPolicy, LruPolicy

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    promotions: int = 0
    demotions: int = 0
    evictions: int = 0
    errors: int = 0


class TierManager:
    def __init__(self, tiers: list[Tier], index=None, policy: EvictionPolicy | None = None,
                 promote_on_read: bool = False, transcoders: dict[str, Callable[[Buffer], Buffer]] | None = None):
        if not tiers:
            raise ValueError("at least one tier is needed")
        self.tiers = tiers
        self.transcoders = dict(transcoders or {})  # tier name -> transcoder
        self.index = index or MemoryTierIndex()
        self.policy = policy or LruPolicy()
        self.promote_on_read = promote_on_read
        self._names = [tier.name for tier in tiers]
        # Writers (put, promote, delete) take turns under `_lock`, through their tier I/O; the placement
        # books (`_lru`, the index) have their own lock, held only for bookkeeping, so a read waits for no
        # write, transcoding, demotion or fsync of another session's blob.
        self._lock = threading.RLock()
        self._books = threading.RLock()
        self._lru: list[OrderedDict[str, int]] = [OrderedDict() for _ in tiers]
        self._stats = [TierStats() for _ in tiers]
        # Counters are bumped from the I/O and restore threads at once: `+=` on an attribute is a read and
        # a write, and a thread switch between them loses a count.
        self._counting = threading.Lock()
        # While DRAM is saved at shutdown: the blobs saved so far, most worth keeping first (none is moved out
        # for one saved after it), and the bytes they hold in each tier
        self._saved: dict[str, None] = {}
        self._saved_sizes: dict[int, int] = {}
        self.missing_at_start = 0
        self._reconcile()

    def use_policy(self, policy: EvictionPolicy) -> None:
        """Hands eviction to `policy`, told first of every blob already placed (least recently used first)."""
        with self._books:
            self.policy = policy
            for index, lru in enumerate(self._lru):
                for key, size in lru.items():
                    policy.placed(index, key, size)

    def tier(self, name: str) -> Tier:
        return self.tiers[self._names.index(name)]

    # -- start-up ----------------------------------------------------------------------------------

    def _reconcile(self) -> None:
        """Rebuilds placement from the index and the tiers: the index decides between duplicate copies,
        blobs the index lost track of are adopted, and entries whose blob is gone are dropped."""
        entries = self.index.load()
        held, unlisted = [], set()
        for index, tier in enumerate(self.tiers):
            tier.recognize(entries)  # a tier whose names hide keys (Redis) can only list keys it is told of
            try:
                held.append(tier.keys())
            except Exception as exc:
                log.warning("tier %s could not list its keys at start-up: %s", tier.name, exc)
                held.append({})
                unlisted.add(index)
            if not tier.available:  # listed nothing because it cannot be reached
                unlisted.add(index)
        for key, tier_name in entries.items():
            home = self._names.index(tier_name) if tier_name in self._names else None
            if home in unlisted:  # unreachable now (Redis down), maybe not for long: trust the index
                self._place(home, key, 0)  # size unknown until the tier is back
                continue
            if home is None or key not in held[home]:
                home = next((i for i, keys in enumerate(held) if key in keys), None)
            if home is None:
                self.missing_at_start += 1
                self.index.remove(key)
                continue
            self._place(home, key, held[home][key])
        for index, keys in enumerate(held):
            for key, size in keys.items():
                home = self._index_of(key)
                if home is None:
                    self._place(index, key, size)
                elif home != index:
                    self._safe_delete(index, key)  # the duplicate left by a crash mid-move
        if self.missing_at_start:
            log.warning("%d indexed KV blobs were missing at start-up", self.missing_at_start)

    def _place(self, index: int, key: str, size: int) -> None:
        with self._books:
            self._lru[index][key] = size
            self.index.set(key, self._names[index])
            self.policy.placed(index, key, size)

    def _take(self, index: int, key: str) -> int | None:
        """Takes the key out of a tier's books (its blob stays until deleted); returns its size."""
        with self._books:
            size = self._lru[index].pop(key, None)
            if size is not None:
                self.policy.taken(index, key)
            return size

    # -- lookups -----------------------------------------------------------------------------------

    def _index_of(self, key: str) -> int | None:
        with self._books:
            return next((i for i, lru in enumerate(self._lru) if key in lru), None)

    def locate(self, key: str) -> str | None:
        index = self._index_of(key)
        return None if index is None else self._names[index]

    def stored_bytes(self, key: str) -> int | None:
        with self._books:
            index = self._index_of(key)
            return None if index is None else self._lru[index].get(key)

    def keys(self) -> set[str]:
        with self._books:
            return {key for lru in self._lru for key in lru}

    def private_keys(self) -> set[str]:
        """Keys held in tiers no other replica writes to."""
        with self._books:
            return {key for tier, lru in zip(self.tiers, self._lru) if not tier.is_shared for key in lru}

    # -- writes ------------------------------------------------------------------------------------

    def put(self, key: str, blob: Buffer, tier: str | None = None) -> str | None:
        """Stores the blob in the fastest tier with room (or from `tier` down); returns the tier it landed
        in, or None when no tier can hold it (the previous copy, if any, is dropped: it is stale)."""
        with self._lock:
            previous = self._index_of(key)
            start = 0 if tier is None else self._names.index(tier)
            if previous is not None:
                self._take(previous, key)  # never its own demotion victim
            landed = self._put_from(start, key, blob)
            if previous is not None and previous != landed:
                self._safe_delete(previous, key)
            if landed is None:
                with self._books:
                    self.index.remove(key)
            return None if landed is None else self._names[landed]

    def _put_from(self, start: int, key: str, original: Buffer, stop: int | None = None) -> int | None:
        """Writes the blob into the first tier from `start` (up to `stop`, exclusive) that takes it."""
        for index in range(start, len(self.tiers) if stop is None else stop):
            tier = self.tiers[index]
            if not tier.available:
                continue  # before transcoding: re-encoding a blob for a tier that cannot take it is waste
            blob = self._transcoded(index, key, original)
            if len(blob) > tier.capacity() - self._saved_bytes(index):
                continue
            try:
                self._write_then_make_room(index, key, blob)
            except TierFull:
                continue
            except Exception:
                self._count(index, "errors")
                log.warning("tier %s failed to store %s", tier.name, key, exc_info=True)
                continue
            self._place(index, key, len(blob))
            return index
        return None

    def _transcoded(self, index: int, key: str, blob: Buffer) -> Buffer:
        transcode = self.transcoders.get(self._names[index])
        if transcode is None:
            return blob
        try:
            return transcode(blob)
        except Exception:
            log.warning("could not transcode %s for tier %s: storing it as it is", key, self._names[index],
                        exc_info=True)
            return blob

    def _write_then_make_room(self, index: int, key: str, blob: Buffer) -> None:
        """The write first, over the budget by this one blob, then the room it needs: a write that fails
        (a full disk, an I/O error) has moved or evicted no other blob. Only a tier that refuses the write as
        full (TierFull) gets room made first, for the write to be tried again."""
        tier = self.tiers[index]
        try:
            with tier.overdraft(len(blob)):
                tier.put(key, blob)
        except TierFull:
            # Within its budget the tier's own storage could not take the write on top of what it holds (LMDB:
            # no run of free pages long enough for a large value once deletes have fragmented the map): room
            # first, then the write again, one more victim at a time; an empty tier that still cannot take it
            # passes it on to the next tier.
            self._make_room(index, len(blob))
            self._put_evicting(index, key, blob)
        self._make_room(index, 0)  # before the new blob is in the LRU: it is never its own victim

    def _put_evicting(self, index: int, key: str, blob: Buffer) -> None:
        tier = self.tiers[index]
        while True:
            try:
                tier.put(key, blob)
                return
            except TierFull:
                self._refresh_usage(index)
                victim = self._victim(index)
                if victim is not None:
                    self._demote(index, victim)
                elif not tier.delete(key):  # the last resort: its own previous copy (a crash now loses the KV,
                    raise  # never the history), else the tier cannot take it at all

    def _make_room(self, index: int, size: int) -> None:
        tier, lru = self.tiers[index], self._lru[index]
        if tier.usage() + size > tier.capacity():
            self._refresh_usage(index)
        while True:
            with self._books:
                if not lru or tier.usage() + size <= tier.capacity():
                    return
            victim = self._victim(index)
            if victim is None:
                return
            self._demote(index, victim)

    def _victim(self, index: int) -> str | None:
        """The policy's victim in the tier, never a blob saved before at shutdown (None: no blob can go)."""
        with self._books:
            entries = self._lru[index] if not self._saved else _Unsaved(self._lru[index], self._saved)
            return None if next(iter(entries), None) is None else self.policy.choose_victim(index, entries)

    def _saved_bytes(self, index: int) -> int:
        """What the blobs saved so far at shutdown hold of the tier: room no later blob may take."""
        return self._saved_sizes.get(index, 0)

    def _refresh_usage(self, index: int) -> None:
        """Before anything is moved out of a tier for room: a shared tier's own count of what it holds."""
        try:
            self.tiers[index].refresh_usage()
        except Exception as exc:  # its books stand as they are
            self._tier_failed(index, "refresh its usage", exc)

    def _demote(self, index: int, key: str) -> None:
        size = self._take(index, key)
        try:
            blob = self.tiers[index].get(key)
        except Exception as exc:  # cannot be moved down: evicted (its conversation recomputes)
            self._tier_failed(index, f"read {key}", exc)
            blob = None
        landed = None if blob is None else self._put_from(index + 1, key, blob)
        if landed is None:
            self._count(index, "evictions")
            with self._books:
                self.index.remove(key)
        else:
            self._count(index, "demotions")
        self._safe_delete(index, key)
        log.debug("moved %s (%d bytes) out of %s", key, size, self._names[index])

    def _safe_delete(self, index: int, key: str) -> None:
        self._take(index, key)
        try:
            self.tiers[index].delete(key)
        except Exception as exc:  # a stale copy may linger (in Redis until its TTL); nothing points at it
            self._tier_failed(index, f"delete {key}", exc)

    def promote(self, key: str, tier: str | None = None) -> str | None:
        """Moves the blob to the fastest tier with room (or to `tier`); returns where it now is."""
        with self._lock:
            current = self._index_of(key)
            target = 0 if tier is None else self._names.index(tier)
            if current is None or current <= target:
                return None if current is None else self._names[current]
            return self._move(key, current, target)

    def move(self, key: str, tier: str) -> str | None:
        """Moves the blob whole to `tier`, up or down (or, as any put, to the next slower tier that takes
        it: going up, only a tier above its own), counted as a promotion or a demotion; where no tier takes
        it, it stays where it was. Returns where it now is (None: it is stored nowhere)."""
        with self._lock:
            current = self._index_of(key)
            target = self._names.index(tier)
            if current is None or current == target:
                return None if current is None else self._names[current]
            return self._move(key, current, target)

    def _move(self, key: str, current: int, target: int) -> str | None:
        try:
            blob = self.tiers[current].get(key)
        except Exception as exc:  # stays where it is
            self._tier_failed(current, f"read {key}", exc)
            return self._names[current]
        if blob is None:
            with self._books:
                self._take(current, key)
                self.index.remove(key)
            return None
        size = self._take(current, key)
        # A move up lands above the blob's tier or not at all: writing it again where it is would cost a whole
        # blob's I/O for nothing (promote on read asks at every read of a blob larger than the tiers above),
        # and a tier that refused that write as full would delete the copy that stays booked below
        landed = self._put_from(target, key, blob, stop=current if target < current else None)
        if landed is None:
            self._place(current, key, size)  # no tier took it: it stays (a move never drops a blob)
            return self._names[current]
        self._count(current, "promotions" if landed < current else "demotions")
        self._safe_delete(current, key)
        return self._names[landed]

    def durable_tier(self) -> str | None:
        """The fastest tier whose blobs outlive this process."""
        return next((tier.name for tier in self.tiers if not tier.is_volatile), None)

    def save_volatile(self, until: float) -> int:
        """Moves the blobs of tiers that die with the process (DRAM) into the tiers below, those most worth
        keeping first (the policy's order: LRU's most recently used), until time.monotonic() passes `until`;
        returns how many it moved. A blob moved never makes room for one moved after it, worth less: that one
        goes further down, or is lost with the process (its conversation recomputes from its history)."""
        moved = 0
        try:
            for index, tier in enumerate(self.tiers):
                if tier.is_volatile:
                    moved += self._save_tier(index, until)
        finally:
            self._rank_saved()
            self._saved, self._saved_sizes = {}, {}
        return moved

    def _save_tier(self, index: int, until: float) -> int:
        with self._books:
            keys = self.policy.keep_first(index, self._lru[index])
        moved = 0
        for key in keys:
            if time.monotonic() >= until:
                break
            with self._lock:
                if self._index_of(key) == index:  # not moved or deleted meanwhile
                    self._demote(index, key)
                    self._saved[key] = None
                    landed = self._index_of(key)  # where it stays: a saved blob is never moved on
                    if landed is not None:
                        self._saved_sizes[landed] = self._saved_sizes.get(landed, 0) + self._lru[landed][key]
                    moved += 1
        return moved

    def _rank_saved(self) -> None:
        """Where they landed, the saved blobs rank as used more recently than what was there, the one most worth
        keeping as the most recent (each landed as its tier's most recent, the least worth last)."""
        with self._books:
            for key in reversed(self._saved):
                for lru in self._lru:
                    if key in lru:
                        lru.move_to_end(key)

    def forget_gone(self) -> int:
        """Takes out of the books the blobs a shared tier (Redis) no longer holds: expired by its TTL, evicted by
        Redis under maxmemory, deleted by another replica. Booked until read otherwise, and most never are: the
        books and the index grew with every conversation that went there. Returns how many it took out. A blob
        still there that another replica stored again is found by the next read (_read_shared)."""
        gone = 0
        for index, tier in enumerate(self.tiers):
            if not tier.is_shared or not tier.available:
                continue
            self._refresh_usage(index)  # what the tier holds (a scan, at most every USAGE_REFRESH_S)
            with self._books:
                booked = list(self._lru[index])
            # The look only names candidates (a blob adopted from another replica is in no look of this one's):
            # each is asked of the store, then taken out only if no write of this process booked it since
            candidates = [key for key in booked if not tier.contains(key)]
            try:
                held = tier.holds_which(candidates)
            except Exception as exc:  # noqa: BLE001 - unreachable now: the next look asks again
                self._tier_failed(index, "look for its blobs", exc)
                continue
            with self._lock, self._books:
                for key in candidates:
                    if key not in held and not tier.contains(key) and self._take(index, key) is not None:
                        self.index.remove(key)
                        gone += 1
        return gone

    def delete(self, key: str) -> None:
        with self._lock:
            with self._books:
                held = [index for index, lru in enumerate(self._lru) if key in lru]
            # A tier shared with other replicas (Redis) may hold it in their books, not this one's: another
            # replica ran the conversation's last turn
            shared = [index for index, tier in enumerate(self.tiers)
                      if tier.is_shared and tier.available and index not in held]
            for index in held + shared:
                self._safe_delete(index, key)
            with self._books:
                self.index.remove(key)

    # -- reads -------------------------------------------------------------------------------------

    @contextmanager
    def read(self, key: str) -> Iterator[tuple[str | None, Buffer | None]]:
        """Yields (tier name, buffer); the buffer may be a zero-copy view valid only inside the block.
        An unreachable tier reads as a miss."""
        with self._books:  # never the writers' lock: a read waits for no other session's write
            index = self._index_of(key)
            if index is not None:
                self._lru[index].move_to_end(key)
        if index is None:
            with self._read_shared(key) as found:
                yield found
            return
        with ExitStack() as stack:
            try:
                blob = stack.enter_context(self.tiers[index].read(key))
            except Exception as exc:  # the KV is a cache: the turn recomputes from history
                self._tier_failed(index, f"read {key}", exc)
                yield None, None
                return
            if blob is None:
                self._count(index, "misses")
                with self._books:
                    if self._take(index, key) is not None:  # unless a writer moved it meanwhile
                        self.index.remove(key)
            else:
                self._count(index, "hits")
                with self._books:  # booked unknown (0) when its tier could not be reached at start-up
                    if self._lru[index].get(key) == 0:
                        self._lru[index][key] = len(blob)
            yield self._names[index], blob
        if blob is not None and self.promote_on_read and index > 0:
            self.promote(key)

    @contextmanager
    def peek(self, key: str) -> Iterator[tuple[str | None, Buffer | None]]:
        """A read that leaves no trace, for a look at a blob's header (the admin's table): no hit, miss or
        error counted, its place in the LRU order kept, never promoted; only a tier this process has it booked
        in. A tier that cannot be read raises."""
        with self._books:
            index = self._index_of(key)
        if index is None:
            yield None, None
            return
        with self.tiers[index].read(key) as blob:
            yield (None, None) if blob is None else (self._names[index], blob)

    @contextmanager
    def _read_shared(self, key: str) -> Iterator[tuple[str | None, Buffer | None]]:
        """A key this process never stored may be in a tier shared with other replicas (Redis): one that
        ran the conversation's last turn stored it there. Found, it is adopted into this process's books."""
        for index, tier in enumerate(self.tiers):
            if not tier.is_shared or not tier.available:
                continue
            with ExitStack() as stack:
                try:
                    blob = stack.enter_context(tier.read(key))
                except Exception as exc:  # the KV is a cache: the turn recomputes from history
                    self._tier_failed(index, f"read {key}", exc)
                    continue
                if blob is None:
                    continue
                tier.recognize([key])
                with self._books:
                    if self._index_of(key) is None:  # unless a writer here placed it meanwhile
                        self._place(index, key, len(blob))
                self._count(index, "hits")
                yield self._names[index], blob
                return
        yield None, None

    def read_bytes(self, key: str) -> bytes | None:
        """The stored blob as bytes of its own (a read's buffer may be a view that closes with it)."""
        with self.read(key) as (_, blob):
            return None if blob is None else bytes(blob)

    def _tier_failed(self, index: int, action: str, exc: Exception) -> None:
        """Counts a tier call that failed; an unreachable tier is expected (no traceback), any other
        error (a disk's I/O error, a full map) is logged with it."""
        self._count(index, "errors")
        if isinstance(exc, TierUnavailable):
            log.info("tier %s could not %s: %s", self._names[index], action, exc)
        else:
            log.warning("tier %s failed to %s", self._names[index], action, exc_info=exc)

    def record_error(self, tier_name: str) -> None:
        """A blob read from this tier failed validation."""
        self._count(self._names.index(tier_name), "errors")

    def _count(self, index: int, event: str) -> None:
        with self._counting:
            stats = self._stats[index]
            setattr(stats, event, getattr(stats, event) + 1)

    # -- reporting ---------------------------------------------------------------------------------

    def stats(self) -> list[dict]:
        with self._counting:
            counts = [asdict(stats) for stats in self._stats]
        return [
            {
                "name": tier.name,
                "available": tier.available,
                "usage_bytes": tier.usage(),
                "budget_bytes": tier.capacity(),
                "blobs": len(lru),
                **count,
            }
            for tier, lru, count in zip(self.tiers, self._lru, counts)
        ]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
        self.index.close()


class _Unsaved(Mapping):
    """A tier's books without the blobs a shutdown saved so far, in their order, read in place: a victim's choice
    copied the whole tier's books once for each blob saved."""

    def __init__(self, entries: OrderedDict[str, int], saved: dict[str, None]):
        self._entries, self._saved = entries, saved

    def __getitem__(self, key: str) -> int:
        if key in self._saved:
            raise KeyError(key)
        return self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return (key for key in self._entries if key not in self._saved)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        return key in self._entries and key not in self._saved
