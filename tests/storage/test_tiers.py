"""Every tier through the same matrix."""

import pytest

from storage.tier import TierFull
from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier
from storage.redis_tier import RedisTier
from storage.ssd import SsdTier

MB = 1 << 20
TIERS = ["dram", "dram in given buffers", "lmdb", "ssd", "redis"]


def _buffer(size: int) -> memoryview:
    return memoryview(bytearray(size))


def build(name, request, tmp_path, budget):
    if name == "dram":
        return DramTier(budget)
    if name == "dram in given buffers":  # as a GPU worker's service gives it page-locked memory
        return DramTier(budget, _buffer)
    if name == "lmdb":
        return LmdbTier(tmp_path / "kv.lmdb", budget)
    if name == "ssd":
        return SsdTier(tmp_path / "files", budget)
    server = request.getfixturevalue("redis_server")
    return RedisTier(server.url, budget, prefix=request.getfixturevalue("redis_prefix"), chunk_bytes=64 * 1024,
                     secret=b"tier-matrix-secret-0123456789abc")


@pytest.fixture(params=TIERS)
def make_tier(request, tmp_path):
    opened = []

    def make(budget=8 * MB):
        tier = build(request.param, request, tmp_path, budget)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        tier.close()


def test_a_dram_tier_with_buffers_holds_a_copy_in_them():
    given = []
    tier = DramTier(MB, lambda size: given.append(_buffer(size)) or given[-1])
    blob = bytearray(b"kv" * 1000)
    tier.put("a", blob)
    blob[:2] = b"xx"  # the caller's buffer is its own again
    assert tier.get("a") is given[0] and bytes(tier.get("a")) == b"kv" * 1000
    assert tier.usage() == 2000


def test_put_get_contains_delete(make_tier):
    tier = make_tier()
    tier.put("a", b"x" * 1000)
    assert tier.contains("a") and not tier.contains("b")
    assert bytes(tier.get("a")) == b"x" * 1000
    with tier.read("a") as view:
        assert bytes(view) == b"x" * 1000
    assert tier.get("b") is None
    assert tier.keys() == {"a": 1000} and tier.usage() == 1000
    assert tier.delete("a") and not tier.delete("a")
    assert tier.usage() == 0 and tier.keys() == {}


def test_overwrite_accounts_once(make_tier):
    tier = make_tier()
    tier.put("a", b"1" * 100)
    tier.put("a", b"2" * 300)
    assert tier.usage() == 300 and bytes(tier.get("a")) == b"2" * 300


def test_budget_is_enforced(make_tier):
    tier = make_tier(budget=1 * MB)
    tier.put("a", bytes(700_000))
    with pytest.raises(TierFull):
        tier.put("b", bytes(400_000))
    assert not tier.contains("b") and tier.usage() == 700_000


def test_lmdb_map_grows_past_its_initial_size_and_persists(tmp_path):
    tier = LmdbTier(tmp_path / "kv.lmdb", 400 * MB)
    blobs = {f"k{i}": bytes([i]) * (40 * MB) for i in range(5)}  # 200 MB > the 64 MB initial map
    for key, blob in blobs.items():
        tier.put(key, blob)
    tier.close()
    reopened = LmdbTier(tmp_path / "kv.lmdb", 400 * MB)
    assert reopened.usage() == 200 * MB
    assert bytes(reopened.get("k3")) == blobs["k3"]
    reopened.close()


def test_blobs_larger_than_a_chunk_roundtrip(make_tier):
    tier = make_tier()
    blob = bytes(range(256)) * 3000  # 768,000 bytes: 12 Redis chunks of 64 KiB
    tier.put("big", blob)
    assert bytes(tier.get("big")) == blob
    with tier.read("big") as view:
        assert bytes(view) == blob


@pytest.mark.parametrize("name", ["lmdb", "ssd", "redis"])
def test_durable_tiers_list_their_blobs_after_reopening(name, request, tmp_path):
    tier = build(name, request, tmp_path, 8 * MB)
    tier.put("a", b"1" * 10)
    tier.put("b/../x", b"2" * 20)  # odd keys never escape the tier's namespace
    tier.close()
    reopened = build(name, request, tmp_path, 8 * MB)
    reopened.recognize(["a", "b/../x"])  # Redis names hide keys: it lists the keys it is told of
    assert reopened.keys() == {"a": 10, "b/../x": 20} and reopened.usage() == 30
    assert bytes(reopened.get("b/../x")) == b"2" * 20
    reopened.close()
