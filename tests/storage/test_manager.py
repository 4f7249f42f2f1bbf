import threading
import time
from contextlib import contextmanager

from storage.tier import TierUnavailable
from storage.dram import DramTier
from storage.index import LmdbTierIndex
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager
from storage.ssd import SsdTier


def _manager(tmp_path, dram_budget=1000, lmdb_budget=2000):
    return TierManager([DramTier(dram_budget), LmdbTier(tmp_path / "kv.lmdb", lmdb_budget)])


def _stats(manager):
    return {s["name"]: s for s in manager.stats()}


def test_new_blob_lands_in_fastest_tier(tmp_path):
    manager = _manager(tmp_path)
    assert manager.put("a", b"x" * 400) == "dram"
    assert manager.locate("a") == "dram" and manager.stored_bytes("a") == 400
    with manager.read("a") as (tier, blob):
        assert tier == "dram" and bytes(blob) == b"x" * 400


def test_least_recently_used_is_demoted_then_evicted(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a" * 400)
    manager.put("b", b"b" * 400)
    with manager.read("a"):
        pass  # a is now more recently used than b
    manager.put("c", b"c" * 400)
    assert manager.locate("b") == "lmdb" and manager.locate("a") == "dram" and manager.locate("c") == "dram"
    assert bytes(manager.tiers[1].get("b")) == b"b" * 400
    assert _stats(manager)["dram"]["demotions"] == 1
    for key in "defgh":
        manager.put(key, key.encode() * 400)
    stats = _stats(manager)
    assert stats["lmdb"]["evictions"] >= 1
    assert manager.tiers[0].usage() <= 1000 and manager.tiers[1].usage() <= 2000
    assert manager.locate("b") is None  # the oldest blob fell off the last tier


def test_blob_larger_than_a_tier_skips_it(tmp_path):
    manager = _manager(tmp_path)
    assert manager.put("big", b"z" * 1500) == "lmdb"
    assert manager.put("huge", b"z" * 5000) is None
    assert manager.locate("huge") is None


def test_rewrite_moves_blob_and_leaves_one_copy(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a" * 1500)
    assert manager.locate("a") == "lmdb"
    manager.put("a", b"a" * 100)
    assert manager.locate("a") == "dram" and not manager.tiers[1].contains("a")


def test_delete_removes_from_every_tier_and_index_survives_restart(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a" * 1500)
    manager.put("b", b"b" * 10)
    manager.delete("b")
    assert manager.keys() == {"a"}
    manager.close()
    reopened = _manager(tmp_path)
    assert reopened.keys() == {"a"} and reopened.locate("a") == "lmdb"
    reopened.close()


def test_hits_and_misses_are_counted(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a")
    with manager.read("a"):
        pass
    with manager.read("nope") as (tier, blob):
        assert tier is None and blob is None
    assert _stats(manager)["dram"]["hits"] == 1


def test_put_can_start_below_the_fastest_tier(tmp_path):
    manager = _manager(tmp_path)
    assert manager.put("a", b"a" * 10, tier="lmdb") == "lmdb"
    assert not manager.tiers[0].contains("a")


def test_promote_moves_to_the_fastest_tier_with_room(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a" * 400, tier="lmdb")
    assert manager.promote("a") == "dram"
    assert manager.tiers[0].contains("a") and not manager.tiers[1].contains("a")
    assert _stats(manager)["lmdb"]["promotions"] == 1
    manager.put("big", b"b" * 1500, tier="lmdb")
    assert manager.promote("big") == "lmdb"  # larger than DRAM's budget: stays
    assert manager.promote("nope") is None


def test_move_goes_up_or_down_whole_and_never_drops_a_blob(tmp_path):
    manager = _manager(tmp_path)
    manager.put("a", b"a" * 400)
    assert manager.move("a", "lmdb") == "lmdb"
    assert manager.tiers[1].contains("a") and not manager.tiers[0].contains("a")
    assert manager.move("a", "dram") == "dram" and not manager.tiers[1].contains("a")
    assert _stats(manager)["dram"]["demotions"] == 1 and _stats(manager)["lmdb"]["promotions"] == 1
    manager.put("big", b"b" * 1500)
    assert manager.move("big", "dram") == "lmdb"  # larger than DRAM's budget: stays where it was
    assert manager.move("nope", "dram") is None
    down = TierManager([DramTier(1000), _DownTier(10_000)])
    down.put("a", b"a" * 10)
    assert down.move("a", "redis") == "dram" and down.stored_bytes("a") == 10  # no tier took it: kept


def test_an_index_that_cannot_be_written_loses_no_blob_and_fails_no_write(tmp_path):
    """The durable index's own writes fail (its disk full; here its map, made small): puts, moves and deletes
    went on raising lmdb's error out of the manager (a 500 for the turn storing its KV), after the blob was
    written. Each still lands and reads back; the next start adopts what the index could not record."""
    keys = [f"{n}-" + "k" * 400 for n in range(8)]  # long keys fill a 32 KiB map after a few entries
    manager = TierManager([DramTier(100), LmdbTier(tmp_path / "kv.lmdb", 100_000)],
                          LmdbTierIndex(tmp_path / "index", map_size=32 << 10))
    for key in keys:
        assert manager.put(key, key.encode()) == "lmdb"
    assert manager.move(keys[0], "dram") == "lmdb"  # too large for DRAM: it stays
    manager.delete(keys[1])
    assert [manager.read_bytes(key) for key in keys] == [keys[0].encode(), None, *(k.encode() for k in keys[2:])]
    manager.close()
    reopened = TierManager([DramTier(100), LmdbTier(tmp_path / "kv.lmdb", 100_000)],
                           LmdbTierIndex(tmp_path / "index", map_size=32 << 10))
    assert reopened.keys() == set(keys) - {keys[1]}  # the delete the index could not record: dropped at start
    reopened.close()


class _CountingLmdbTier(LmdbTier):
    def __init__(self, path, budget):
        super().__init__(path, budget)
        self.writes = 0

    def put(self, key, blob):
        self.writes += 1
        super().put(key, blob)


def test_a_promotion_no_faster_tier_takes_leaves_the_blob_unwritten_where_it_is(tmp_path):
    """A blob larger than DRAM asked up from LMDB (promote on read does so at every read) was written again
    where it already was: a whole blob's I/O for nothing, and, where that tier then refused it as full, its
    copy there was deleted to make room and booked again as held (a blob that read as a miss)."""
    manager = TierManager([DramTier(1000), _CountingLmdbTier(tmp_path / "kv.lmdb", 2000)])
    manager.put("big", b"b" * 1500)
    assert manager.tiers[1].writes == 1
    assert manager.promote("big") == "lmdb" and manager.move("big", "dram") == "lmdb"
    assert manager.tiers[1].writes == 1 and bytes(manager.tiers[1].get("big")) == b"b" * 1500
    assert _stats(manager)["lmdb"]["promotions"] == 0


def test_promote_on_read_policy(tmp_path):
    manager = TierManager([DramTier(1000), LmdbTier(tmp_path / "kv.lmdb", 2000)], promote_on_read=True)
    manager.put("a", b"a" * 10, tier="lmdb")
    with manager.read("a") as (tier, blob):
        assert tier == "lmdb"
    assert manager.locate("a") == "dram"


class _DownTier(DramTier):
    name = "redis"
    available = False

    def put(self, key, blob):
        raise TierUnavailable("down")

    def keys(self):
        raise TierUnavailable("down")

    @contextmanager
    def read(self, key):
        raise TierUnavailable("down")
        yield


def test_unavailable_tier_is_skipped_on_write_and_reads_as_a_miss(tmp_path):
    down = _DownTier(10_000)
    manager = TierManager([down, LmdbTier(tmp_path / "kv.lmdb", 2000)])
    assert manager.put("a", b"a" * 10) == "lmdb"
    manager._lru[0]["ghost"] = 5  # indexed in the down tier
    with manager.read("ghost") as (tier, blob):
        assert tier is None and blob is None
    assert _stats(manager)["redis"]["errors"] == 1 and _stats(manager)["redis"]["available"] is False


def test_reconcile_drops_missing_adopts_unindexed_and_removes_duplicates(tmp_path):
    index = LmdbTierIndex(tmp_path / "index")
    lmdb = LmdbTier(tmp_path / "kv.lmdb", 10_000)
    ssd = SsdTier(tmp_path / "files", 10_000)
    lmdb.put("dup", b"new")  # a crash mid-move: the index already names lmdb, ssd still has a copy
    ssd.put("dup", b"old")
    ssd.put("unindexed", b"u")
    index.set("dup", "lmdb")
    index.set("gone", "ssd")  # its blob vanished
    manager = TierManager([DramTier(1000), lmdb, ssd], index)
    assert manager.missing_at_start == 1 and manager.locate("gone") is None
    assert manager.locate("dup") == "lmdb" and not ssd.contains("dup")
    assert manager.locate("unindexed") == "ssd"
    assert index.load() == {"dup": "lmdb", "unindexed": "ssd"}
    manager.close()


def test_a_tier_transcoder_sees_every_blob_landing_in_it_and_a_failing_one_stores_the_original(tmp_path):
    def halve(blob):
        if bytes(blob).startswith(b"bad"):
            raise ValueError("cannot transcode")
        return bytes(blob)[: len(blob) // 2]

    manager = TierManager([DramTier(300), LmdbTier(tmp_path / "kv.lmdb", 4000)], transcoders={"lmdb": halve})
    manager.put("a", b"a" * 200)
    manager.put("b", b"b" * 200)  # demotes a into lmdb, through the transcoder
    assert manager.locate("a") == "lmdb" and manager.tier("lmdb").get("a") == b"a" * 100
    assert manager.stored_bytes("a") == 100 and manager.tier("dram").get("b") == b"b" * 200
    assert manager.put("c", b"bad" * 100, tier="lmdb") == "lmdb" and manager.tier("lmdb").get("c") == b"bad" * 100
    assert manager.promote("a") == "dram"  # no transcoder there: it arrives as lmdb held it
    assert manager.tier("dram").get("a") == b"a" * 100 and manager.locate("b") == "dram"


class _FailingLmdbTier(LmdbTier):
    """A disk that refuses some writes (full, or an I/O error) after the tier's own budget said yes."""

    def __init__(self, path, budget, refused: set[str]):
        super().__init__(path, budget)
        self.refused = refused

    def put(self, key, blob):
        if key in self.refused:
            raise OSError(28, "No space left on device")
        super().put(key, blob)


def test_a_write_that_fails_demotes_and_evicts_nothing(tmp_path):
    """Issue 14 item 6: room was made (others demoted, the last tier's LRU evicted) before the write, which
    then failed: the others' states were lost for a blob that never landed."""
    manager = TierManager([DramTier(1000), _FailingLmdbTier(tmp_path / "kv.lmdb", 1000, refused={"c", "z"})])
    for key in "ab":
        manager.put(key, key.encode() * 400, tier="lmdb")
    assert manager.put("c", b"c" * 400, tier="lmdb") is None  # needs room, and its write fails
    assert manager.locate("a") == manager.locate("b") == "lmdb"
    assert bytes(manager.tiers[1].get("a")) == b"a" * 400 and _stats(manager)["lmdb"]["evictions"] == 0
    assert manager.tiers[1].usage() == 800
    assert manager.put("d", b"d" * 400, tier="lmdb") == "lmdb"  # a write that lands still makes its room
    assert manager.locate("a") is None and manager.tiers[1].usage() <= 1000


class _SlowDramTier(DramTier):
    def __init__(self, budget, seconds):
        super().__init__(budget)
        self.seconds = seconds

    def put(self, key, blob):
        time.sleep(self.seconds)  # a slow write: a big blob, a transcoder, an fsync
        super().put(key, blob)


def test_a_read_never_waits_for_another_sessions_write(tmp_path):
    """Issue 14's lock hygiene: the manager held its one lock through every write, so a restore waited
    for another session's whole offload (its transcoding, demotions, fsyncs)."""
    manager = TierManager([_SlowDramTier(10_000, seconds=0.0), LmdbTier(tmp_path / "kv.lmdb", 10_000)])
    manager.put("restored", b"r" * 100)
    manager.tiers[0].seconds = 1.0
    writer = threading.Thread(target=manager.put, args=("offloaded", b"o" * 100))
    writer.start()
    time.sleep(0.1)  # the write is under way
    started = time.monotonic()
    with manager.read("restored") as (tier, blob):
        assert tier == "dram" and bytes(blob) == b"r" * 100
    waited = time.monotonic() - started
    writer.join()
    assert waited < 0.3 and manager.locate("offloaded") == "dram"


def test_tier_counters_are_exact_under_concurrent_increments(tmp_path):
    """The I/O and restore threads count at once; a `+=` on a shared counter loses a count now and then."""
    manager = TierManager([DramTier(10_000)])
    manager.put("a", b"a" * 100)
    threads, increments = 8, 100_000
    start = threading.Barrier(threads)

    def count_errors():
        start.wait()
        for _ in range(increments):
            manager.record_error("dram")

    def read_hits():
        start.wait()
        for _ in range(increments // 50):
            with manager.read("a") as (_, blob):
                assert blob is not None

    for target in (count_errors, read_hits):
        workers = [threading.Thread(target=target) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    dram = _stats(manager)["dram"]
    assert dram["errors"] == threads * increments
    assert dram["hits"] == threads * increments // 50


def test_large_blobs_keep_landing_in_an_lmdb_tier_that_deletes_have_fragmented(tmp_path):
    """Blobs of 1-8 MiB replacing each other in a 32 MiB LMDB tier: once deletes have scattered its free
    pages, a large value finds no run long enough within the map's limit. Every blob that fits the budget must
    still land there (the least recently used ones leave for it), not fall out of storage."""
    import random

    from storage.lmdb_tier import LmdbTier

    rng = random.Random(0)
    manager = TierManager([LmdbTier(tmp_path / "kv", 32 << 20)])
    landed = [manager.put(f"k{rng.randrange(60)}", bytes(rng.randrange(1 << 20, 8 << 20))) for _ in range(240)]
    assert landed.count(None) == 0
    assert manager.tiers[0].usage() <= 32 << 20


def test_saving_dram_at_shutdown_into_full_tiers_keeps_the_most_recently_used(tmp_path):
    """DRAM's blobs move down at shutdown most recently used first; each landed as the lower tier's most recent,
    so once the tier was full the next (older) one displaced the one moved before it: the newest state was lost
    and an older one kept. The lower tier keeps the newest blobs, newest as its most recently used."""
    manager = TierManager([DramTier(1200), LmdbTier(tmp_path / "kv.lmdb", 800)])
    for key in "xyabc":  # x and y, the oldest, are demoted to LMDB as a, b and c arrive
        manager.put(key, key.encode() * 400)
    assert [manager.locate(key) for key in "xyabc"] == ["lmdb"] * 2 + ["dram"] * 3
    assert manager.save_volatile(time.monotonic() + 60) == 3
    assert [manager.locate(key) for key in "xyabc"] == [None, None, None, "lmdb", "lmdb"]
    manager.put("d", b"d" * 400, tier="lmdb")
    assert manager.locate("b") is None and manager.locate("c") == "lmdb"  # c stayed the more recently used
