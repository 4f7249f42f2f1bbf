"""The per-conversation lease in a real Redis (statekeeper/coordination.py)."""

import dataclasses
import time

import pytest

from statekeeper.coordination import ConversationLeases, CoordinationUnavailable
from benchmarks.harness.redis_server import free_port


@pytest.fixture
def leases(redis_server, redis_prefix):
    made = []

    def make(ttl_ms=10_000):
        made.append(ConversationLeases(redis_server.url, key_prefix=redis_prefix, ttl_ms=ttl_ms))
        return made[-1]

    yield make
    for lease_store in made:
        lease_store.close()


def test_one_holder_at_a_time_and_each_grant_fences_the_ones_before(leases):
    a, b = leases(), leases()  # two replicas
    held = a.try_acquire("c1")
    assert held is not None and b.try_acquire("c1") is None
    assert b.try_acquire("c2") is not None  # another conversation is free
    b.release(dataclasses.replace(held, owner="not-the-holder"))  # another owner token: nothing happens
    assert b.try_acquire("c1") is None
    a.release(held)
    taken = b.try_acquire("c1")
    assert taken is not None and taken.fence > held.fence


def test_a_lease_expires_unless_renewed_and_a_lost_lease_cannot_be_renewed(leases):
    a, b = leases(ttl_ms=300), leases(ttl_ms=300)
    held = a.try_acquire("c1")
    for _ in range(3):  # renewed past its time to live
        time.sleep(0.15)
        assert a.renew(held)
    assert b.try_acquire("c1") is None
    time.sleep(0.45)  # its holder stopped renewing (died): it expires by itself
    taken = b.try_acquire("c1")
    assert taken is not None and taken.fence > held.fence
    assert not a.renew(held)  # the old holder learns it lost it ...
    a.release(held)  # ... and cannot free the new holder's
    assert a.try_acquire("c1") is None


def test_no_redis_is_unavailable_not_a_grant():
    lease_store = ConversationLeases(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=0.2)
    with pytest.raises(CoordinationUnavailable):
        lease_store.try_acquire("c1")
    lease_store.close()


def test_tokens_keep_growing_after_redis_loses_its_counters(leases, redis_server, redis_prefix):
    """A Redis restarted without persistence forgets every counter: the next token is still newer than any
    granted before, or the history would refuse every commit of the conversation from then on."""
    import redis

    a = leases()
    first = a.try_acquire("c1")
    a.release(first)
    second = a.try_acquire("c1")
    assert second.fence == first.fence + 1
    a.release(second)
    client = redis.Redis.from_url(redis_server.url)
    client.delete(*client.keys(f"{redis_prefix}*:fence"))  # as a restart would
    client.close()
    third = a.try_acquire("c1")
    assert third.fence > second.fence


def test_lease_keys_name_no_conversation_and_none_outlives_its_use(leases, redis_server, redis_prefix):
    """Key names go to SCAN, MONITOR and the slow log: a conversation id there opens the conversation to
    whoever reads them. The fencing counter expires (a lost counter restarts above every token granted,
    see the test above), so a key is not kept for every conversation that ever had a turn."""
    import redis

    store = leases(ttl_ms=1_000)
    conversation = "Jd2xS0mePrivateConversationId000"
    store.release(store.try_acquire(conversation))
    client = redis.Redis.from_url(redis_server.url)
    names = [name.decode() for name in client.scan_iter(match=f"{redis_prefix}*")]
    assert names and not any(conversation in name for name in names)
    assert all(0 < client.pttl(name) for name in names)
    store.forget(conversation)  # the conversation was deleted
    assert not list(client.scan_iter(match=f"{redis_prefix}*"))
