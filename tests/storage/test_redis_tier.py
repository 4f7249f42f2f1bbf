"""Against a real redis-server: chunk layout, hash tags, TTL, password, and outages."""

import time

import pytest
import redis

from storage.base import TierUnavailable
from storage.redis_tier import RedisTier
from tests.utils.redis_server import RedisServer


def test_chunks_share_one_hash_tag_and_carry_the_ttl(redis_server, redis_prefix):
    tier = RedisTier(redis_server.url, 1 << 30, prefix=redis_prefix, ttl_seconds=600, chunk_bytes=1000)
    tier.put("sess", b"x" * 3500)
    client = redis.Redis.from_url(redis_server.url)
    names = sorted(k.decode() for k in client.scan_iter(match=f"{redis_prefix}*"))
    assert len(names) == 5  # 4 chunks + meta
    assert all(name.startswith(f"{redis_prefix}{{sess}}:") for name in names)
    assert all(0 < client.ttl(name) <= 600 for name in names)
    tier.put("sess", b"y" * 1500)  # a rewrite leaves no chunks of the old generation behind
    assert len(list(client.scan_iter(match=f"{redis_prefix}*"))) == 3
    assert tier.get("sess") == b"y" * 1500
    tier.delete("sess")
    assert list(client.scan_iter(match=f"{redis_prefix}*")) == []


def test_password_protected_server(tmp_path):
    server = RedisServer(tmp_path, password="s3cret-pass").start()
    try:
        tier = RedisTier(server.url, 1 << 20, password="s3cret-pass")
        tier.put("k", b"v")
        assert tier.get("k") == b"v"
        with pytest.raises(redis.AuthenticationError):
            RedisTier(server.url, 1 << 20, password="wrong")
    finally:
        server.stop()


def _wait_until(condition, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_killed_redis_fails_fast_and_comes_back_on_its_own(tmp_path):
    server = RedisServer(tmp_path).start()
    tier = RedisTier(server.url, 1 << 20)
    try:
        tier.put("k", b"v")
        server.kill()
        started = time.monotonic()
        with pytest.raises(TierUnavailable):
            tier.put("k2", b"v2")
        assert time.monotonic() - started < 1.0  # a couple of quick retries, not seconds of sleep in a request
        assert not tier.available
        started = time.monotonic()
        with pytest.raises(TierUnavailable):
            tier.get("k")  # refused at once while it is down
        assert time.monotonic() - started < 0.05
        server = RedisServer(tmp_path, port=server.port).start()
        assert _wait_until(lambda: tier.available)  # no request needed: it reconnects in the background
        tier.put("k3", b"v3")
        assert tier.get("k3") == b"v3"
    finally:
        tier.close()
        server.stop()


def test_a_redis_down_at_start_comes_back(tmp_path):
    server = RedisServer(tmp_path)  # not started yet
    tier = RedisTier(server.url, 1 << 20)
    try:
        assert not tier.available
        with pytest.raises(TierUnavailable):
            tier.put("k", b"v")
        server.start()
        assert _wait_until(lambda: tier.available)
        tier.put("k", b"v")
        assert tier.get("k") == b"v"
    finally:
        tier.close()
        server.stop()


@pytest.mark.parametrize("garbage", ["wrong type", "not json", "forged meta"])
def test_foreign_values_under_the_prefix_read_as_missing_and_are_overwritten(redis_server, redis_prefix, garbage):
    """Keys of another type or records that are not the tier's own: never a raw redis or JSON error."""
    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, chunk_bytes=4)
    tier.put("a", b"x" * 10)
    client = redis.Redis.from_url(redis_server.url)
    for name in client.scan_iter(match=f"{redis_prefix}*"):
        if garbage == "wrong type":
            client.delete(name)
            client.rpush(name, b"x")
        elif garbage == "not json":
            client.set(name, b"\xff{not json")
        else:
            client.set(name, b'{"generation": "zz", "chunks": 1000000000, "size": -1}')
    try:
        assert tier.get("a") is None
        with tier.read("a") as blob:
            assert blob is None
        RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix).close()  # a start-up scan over it
        tier.put("a", b"y" * 10)
        assert tier.get("a") == b"y" * 10
        assert tier.delete("a")
    finally:
        tier.close()
