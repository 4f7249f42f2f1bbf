from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager


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
