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


def test_outage_marks_the_tier_unavailable_and_it_comes_back(tmp_path):
    server = RedisServer(tmp_path).start()
    tier = RedisTier(server.url, 1 << 20, socket_timeout=0.5)
    tier.put("k", b"v")
    server.stop()
    with pytest.raises(TierUnavailable):
        tier.put("k2", b"v2")
    assert not tier.available and not tier.ping()
    with pytest.raises(TierUnavailable):
        tier.get("k")  # within the backoff window: refused at once, no socket wait
    server = RedisServer(tmp_path, port=server.port).start()
    try:
        deadline = time.monotonic() + 10
        while not tier.ping() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tier.available
        tier.put("k3", b"v3")
        assert tier.get("k3") == b"v3"
    finally:
        server.stop()
