"""Against a real redis-server: chunk layout, hash tags, TTL, password, and outages."""

import time

import pytest
import redis

from storage.tier import TierUnavailable
from storage.redis_tier import RedisTier
from benchmarks.harness.redis_server import RedisServer


def test_chunks_share_one_hash_tag_and_carry_the_ttl(redis_server, redis_prefix):
    tier = RedisTier(redis_server.url, 1 << 30, prefix=redis_prefix, ttl_seconds=600, chunk_bytes=1000)
    tier.put("sess", b"x" * 3500)
    client = redis.Redis.from_url(redis_server.url)
    names = sorted(k.decode() for k in client.scan_iter(match=f"{redis_prefix}*"))
    assert len(names) == 5  # 4 chunks + meta
    tags = {name[len(redis_prefix):].split("}")[0] for name in names}
    assert len(tags) == 1 and all(name.startswith(f"{redis_prefix}{{") for name in names) and tags != {"{sess"}
    assert all(0 < client.ttl(name) <= 600 for name in names)
    tier.put("sess", b"y" * 1500)  # a rewrite leaves no chunks of the old generation behind
    assert len(list(client.scan_iter(match=f"{redis_prefix}*"))) == 3
    assert tier.get("sess") == b"y" * 1500
    tier.delete("sess")
    assert list(client.scan_iter(match=f"{redis_prefix}*")) == []


def test_password_protected_server(tmp_path, caplog):
    caplog.set_level("DEBUG")
    server = RedisServer(tmp_path, password="s3cret-pass").start()
    url_with_password = f"redis://:s3cret-pass@127.0.0.1:{server.port}/0"
    try:
        tier = RedisTier(server.url, 1 << 20, password="s3cret-pass")
        tier.put("k", b"v")
        assert tier.get("k") == b"v"
        with pytest.raises(redis.AuthenticationError) as refused:
            RedisTier(url_with_password.replace("s3cret-pass", "wrong-pass"), 1 << 20)
        assert "wrong-pass" not in str(refused.value)
        in_url = RedisTier(url_with_password, 1 << 20)
        server.kill()  # outage and reconnect are logged: never with the password
        with pytest.raises(TierUnavailable):
            in_url.put("k2", b"v")
        server = RedisServer(tmp_path, port=server.port, password="s3cret-pass").start()
        assert _wait_until(lambda: in_url.available)
        assert "s3cret-pass" not in caplog.text + repr(in_url) + repr(tier)
        assert "redis tier unavailable" in caplog.text and "redis tier is back" in caplog.text
        in_url.close()
        tier.close()
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


@pytest.mark.parametrize("garbage", ["wrong type", "not json", "forged meta", "float chunk count"])
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
        elif garbage == "float chunk count":  # equal to the right count, and no range() takes it
            if name.endswith(b":meta"):
                client.set(name, b'{"generation": "zz", "chunks": 3.0, "size": 10, "mac": "x"}')
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


SECRET = b"0123456789abcdef0123456789abcdef"


def test_key_names_do_not_reveal_keys(redis_server, redis_prefix):
    session = "Jd2sEcReT-session-id-xyz"
    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, secret=SECRET)
    tier.put(session, b"x" * 100)
    client = redis.Redis.from_url(redis_server.url)
    names = [name.decode() for name in client.scan_iter(match=f"{redis_prefix}*")]
    assert names and not any(session in name for name in names)
    tier.close()
    restarted = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, secret=SECRET)
    restarted.recognize([session, "never-stored"])  # what the durable index says is there
    assert restarted.keys() == {session: 100} and restarted.contains(session)
    assert restarted.get(session) == b"x" * 100
    restarted.close()


def test_blobs_are_authenticated_with_the_secret(redis_server, redis_prefix):
    """Anyone who can write to the shared Redis: tampered bytes, or another key's blob copied over this
    key's, are refused (TierUnavailable) instead of read; another secret does not even find the key."""
    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, secret=SECRET)
    tier.put("a", b"a" * 100)
    client = redis.Redis.from_url(redis_server.url)
    assert RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, secret=b"another secret of 32 bytes......").get("a") is None
    for name in client.scan_iter(match=f"{redis_prefix}*"):
        if client.get(name) == b"a" * 100:
            client.setrange(name, 10, b"b")  # tampered in place: same size
    with pytest.raises(TierUnavailable):
        tier.get("a")
    assert tier.available  # a forged blob is not an outage
    tier.put("a", b"a" * 100)
    tier.put("b", b"b" * 100)
    records = {name: client.get(name) for name in client.scan_iter(match=f"{redis_prefix}*")}

    def tag(name: bytes) -> bytes:
        return name.split(b"{", 1)[1].split(b"}", 1)[0]

    tags = {tag(name) for name in records}
    assert len(tags) == 2
    for name, value in records.items():  # each key's records replayed under the other key's names
        own = tag(name)
        client.set(name.replace(own, next(t for t in tags if t != own)), value)
    for key in ("a", "b"):
        with pytest.raises(TierUnavailable):
            tier.get(key)
    tier.close()


def test_two_replicas_rewriting_one_blob_at_once_leave_no_chunks_behind(redis_server, redis_prefix):
    """Each put read the meta record, wrote its own generation and deleted the one it had read: two puts of
    one key at once both deleted the same old generation, and the chunks of the one that lost stayed in Redis
    for good (no TTL by default, and nothing counts or finds them)."""
    import threading

    replicas = [RedisTier(redis_server.url, 1 << 30, prefix=redis_prefix, chunk_bytes=1000, secret=b"s" * 32)
                for _ in range(2)]
    start = threading.Barrier(2)

    def rewrite(tier, fill):
        start.wait()
        for _ in range(100):
            tier.put("conversation", fill * 3500)

    threads = [threading.Thread(target=rewrite, args=(tier, fill)) for tier, fill in zip(replicas, (b"a", b"b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client = redis.Redis.from_url(redis_server.url)
    assert len(list(client.scan_iter(match=f"{redis_prefix}*"))) == 5  # one blob's 4 chunks and its meta
    assert replicas[0].get("conversation") in (b"a" * 3500, b"b" * 3500)


def test_a_replica_finds_a_blob_another_replica_stored_in_the_shared_tier(tmp_path, redis_server, redis_prefix):
    """Replicas share Redis, not their tier books: a key this manager never stored is looked up in the
    shared tier on its first read and adopted (issue 18); one stored nowhere is still a miss."""
    from storage.dram import DramTier
    from storage.manager import TierManager

    def replica():
        return TierManager([DramTier(1 << 20), RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix,
                                                          secret=b"s" * 32)])

    a, b = replica(), replica()
    assert a.put("conversation", b"kv" * 100, "redis") == "redis"
    with b.read("conversation") as (tier, blob):
        assert (tier, bytes(blob)) == ("redis", b"kv" * 100)
    assert b.locate("conversation") == "redis"
    with b.read("never-stored") as (tier, blob):
        assert (tier, blob) == (None, None)
    a.close()
    b.close()


def test_a_delete_on_one_replica_reaches_the_blob_another_stored_in_the_shared_tier(redis_server, redis_prefix):
    """A DELETE may reach any replica: the one that did not store the conversation's KV in Redis has it in no
    books, and deleted nothing there; the blob outlived its conversation and was read back."""
    from storage.dram import DramTier
    from storage.manager import TierManager

    def replica():
        return TierManager([DramTier(1 << 20), RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix,
                                                          secret=b"s" * 32)])

    a, b = replica(), replica()
    assert a.put("conversation", b"kv" * 100, "redis") == "redis"
    b.delete("conversation")
    with a.read("conversation") as (_, blob), b.read("conversation") as (_, other_blob):
        assert (blob, other_blob) == (None, None)
    a.close()
    b.close()


def test_room_another_replica_freed_in_the_shared_tier_is_used_not_made_again(redis_server, redis_prefix):
    """A replica counts what the shared tier holds when it connects; another replica's deletes (and the TTL)
    happen later. Before making room it reads the tier again: it used to evict its own blobs on every put."""
    import time

    from storage.manager import TierManager
    from storage.redis_tier import USAGE_REFRESH_S

    def tier():
        return RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, secret=b"s" * 32)

    other = TierManager([tier()])
    other.put("their-conversation", bytes(900_000))
    mine = TierManager([tier()])  # counts the other's blob
    other.delete("their-conversation")
    time.sleep(USAGE_REFRESH_S)
    assert mine.put("conversation", bytes(500_000)) == "redis"
    assert mine.put("another", bytes(1_000)) == "redis"
    assert mine.locate("conversation") == "redis" and mine.stats()[0]["evictions"] == 0
    other.close()
    mine.close()


def test_replicas_sharing_a_redis_stay_within_its_bound_and_read_evicted_blobs_as_missing(tmp_path):
    """Two replicas, each allowed the whole budget, write three times what the Redis may hold (compose's
    Redis: maxmemory with allkeys-lru, docker/redis/entrypoint.sh). Redis holds the shared bound and
    evicts the least recently used keys, whoever wrote them; a blob that lost its meta or a chunk reads as
    missing (its conversation recomputes), never as another blob, and leaves each replica's books."""
    maxmemory = 4 * 1024 * 1024
    server = RedisServer(tmp_path, options=("--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru")).start()
    try:
        secret = b"shared-replica-secret-0123456789ab"
        replicas = [RedisTier(server.url, budget_bytes=3 * maxmemory, prefix="bound:", chunk_bytes=64 * 1024,
                              secret=secret) for _ in range(2)]
        blobs = {f"conversation-{i}": bytes([i % 251]) * (200 * 1024 + i) for i in range(60)}  # ~12 MB in all
        for number, (key, blob) in enumerate(blobs.items()):
            replicas[number % 2].put(key, blob)
        client = redis.Redis.from_url(server.url)
        assert client.info("memory")["used_memory"] <= maxmemory * 1.05
        found = 0
        for number, (key, blob) in enumerate(blobs.items()):
            writer, reader = replicas[number % 2], replicas[(number + 1) % 2]
            got = reader.get(key)
            assert got is None or bytes(got) == blob
            found += got is not None
            if writer.get(key) is None:  # evicted: gone from the writer's books too, so it no longer counts
                assert not writer.contains(key) and key not in writer.keys()
        assert 0 < found < len(blobs)
        assert replicas[1].get("conversation-59") is not None or replicas[0].get("conversation-59") is not None
        for replica in replicas:
            assert replica.usage() <= 3 * maxmemory
            replica.close()
    finally:
        server.stop()


def test_a_write_redis_refuses_for_memory_is_a_full_tier_not_an_outage(tmp_path):
    from storage.tier import TierFull

    server = RedisServer(tmp_path, options=("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")).start()
    try:
        tier = RedisTier(server.url, budget_bytes=64 * 1024 * 1024, prefix="full:", chunk_bytes=256 * 1024)
        with pytest.raises(TierFull):
            for i in range(40):
                tier.put(f"k{i}", b"x" * (256 * 1024))
        assert tier.available and tier.get("k0") is not None
        tier.close()
    finally:
        server.stop()


def test_blobs_redis_dropped_leave_the_books_at_the_next_check(redis_server, redis_prefix):
    """Blobs that left Redis on their own (the TTL, maxmemory, another replica's delete) stayed in this replica's
    books until read, which most never are: its memory and index grew with every conversation that went to
    Redis, the admin counted them, and a tenant's stored-bytes limit counted KV that was gone."""
    from storage.manager import TierManager

    manager = TierManager([RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix, ttl_seconds=1)])
    for key in ("a", "b", "c"):
        manager.put(key, key.encode() * 100)
    assert manager.forget_gone() == 0  # all there
    time.sleep(1.6)  # expired, and past the tier's least time between two looks
    manager.put("d", b"d" * 100)
    assert manager.forget_gone() == 3
    assert [manager.locate(key) for key in "abcd"] == [None, None, None, "redis"]
    assert manager.stored_bytes("a") is None and manager.stats()[0]["blobs"] == 1


def test_the_tier_forgets_the_keys_it_deleted(redis_server, redis_prefix):
    """The tier's table of the keys behind its hashed names kept every key it ever stored: about 200 bytes a
    conversation for the life of the process."""
    import gc
    import tracemalloc

    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix)

    def cycles(start: int, count: int) -> None:
        for number in range(start, start + count):
            tier.put(f"conversation-{number:08d}", b"x")
            tier.delete(f"conversation-{number:08d}")

    cycles(0, 200)  # the client's buffers and pools warmed up
    tracemalloc.start()
    try:
        gc.collect()  # garbage the client left is not what grows
        before = tracemalloc.take_snapshot()
        cycles(200, 2_000)
        gc.collect()
        grown = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 50_000  # 2,000 keys kept were ~370 kB


def test_a_blob_stored_while_the_tier_is_looked_over_stays_booked(redis_server, redis_prefix, monkeypatch):
    """The look at what Redis holds took its sizes as of the SCAN, then replaced the tier's books with them: a
    blob stored meanwhile was taken out of this replica's books though Redis held it, and no replica would
    ever move it out again."""
    from storage.manager import TierManager

    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix)
    manager = TierManager([tier])
    manager.put("old", b"o" * 100)
    scan_iter = tier._client.scan_iter

    def a_put_meanwhile(*args, **kwargs):
        names = list(scan_iter(*args, **kwargs))
        manager.put("fresh", b"f" * 100)  # another session's offload, on the other I/O thread
        yield from names

    monkeypatch.setattr(tier._client, "scan_iter", a_put_meanwhile)
    time.sleep(1.1)  # past the least time between two looks (one ran at the connection)
    assert manager.forget_gone() == 0
    assert manager.locate("fresh") == "redis" and tier.usage() == 200


def test_two_looks_at_once_keep_what_was_stored_meanwhile(redis_server, redis_prefix, monkeypatch):
    """A look at a large tier outlasts the least time between two: a second one began inside it, and the first
    one's end failed on the second's (a TypeError, the look thrown away) and dropped what was stored meanwhile."""
    import threading

    import storage.redis_tier

    monkeypatch.setattr(storage.redis_tier, "USAGE_REFRESH_S", 0.0)
    tier = RedisTier(redis_server.url, 1 << 20, prefix=redis_prefix)
    tier.put("old", b"o" * 100)
    scan_iter, looks = tier._client.scan_iter, []

    def a_put_and_a_second_look_meanwhile(*args, **kwargs):
        names = list(scan_iter(*args, **kwargs))
        if not looks:
            looks.append(1)
            tier.put("fresh", b"f" * 100)
            second = threading.Thread(target=tier.refresh_usage)
            second.start()
            second.join()
        yield from names

    monkeypatch.setattr(tier._client, "scan_iter", a_put_and_a_second_look_meanwhile)
    tier.refresh_usage()
    assert tier.contains("fresh") and tier.usage() == 200


def test_blobs_gone_at_once_leave_the_books_in_a_few_round_trips(redis_server, redis_prefix, monkeypatch):
    """Each blob the look missed was asked of Redis alone: after a flush (a restart without persistence) a
    replica's books of 100k blobs took as many round trips, on an I/O thread, under the writers' lock."""
    import redis.connection

    from storage.manager import TierManager

    manager = TierManager([RedisTier(redis_server.url, 1 << 24, prefix=redis_prefix)])
    for number in range(2_000):
        manager.put(f"conversation-{number}", b"x")
    redis.Redis.from_url(redis_server.url).flushdb()
    time.sleep(1.1)  # past the least time between two looks
    sent, send = [], redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *args, **kwargs: sent.append(1) or send(self, *args, **kwargs))
    assert manager.forget_gone() == 2_000
    assert len(sent) <= 20
