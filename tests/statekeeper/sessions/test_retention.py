"""Retention controls in the service (statekeeper/placement/retention.py): pinned and higher-priority
conversations leave memory last, a pinned blob stays in a full tier while anything else can go, a TTL drops
the stored KV (never the history), and a tenant's defaults apply under a conversation's own settings."""

import asyncio
import time

import pytest

from statekeeper.sessions import InvalidRequest, TurnRequest

MESSAGE = "Tell me about the history of Rome, briefly."


async def _turn(service, session, tenant=""):
    async for event in service.turn(session, TurnRequest(MESSAGE, max_tokens=4), tenant):
        pass
    return event


def test_the_active_budget_offloads_pinned_conversations_last(make_service):
    service = make_service()

    async def scenario():
        pinned = (await service.create(None, None, retention={"pinned": True})).id
        other = (await service.create(None, None)).id
        for session in (pinned, other):  # the pinned one is the least recently used
            await _turn(service, session)
        service.config.active_kv_budget_bytes = max(live.cache.allocated_bytes for live in service.sessions.active())
        await service.sweep()
        assert [(await service.view(s)).state for s in (pinned, other)] == ["active", "inactive"]

    asyncio.run(scenario())


def _blob_bytes(make_service, tmp_path) -> int:
    probe = make_service(tiers=("dram",), data_dir=tmp_path / "probe")

    async def scenario():
        session = (await probe.create(None, None)).id
        await _turn(probe, session)
        return (await probe.offload(session)).stored_bytes

    return asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_a_pinned_blob_stays_in_a_full_tier_while_another_can_go(make_service, tmp_path, policy):
    """Room for two blobs: the pinned one is stored first (least recently used), yet the third offload
    moves out the other one."""
    size = _blob_bytes(make_service, tmp_path)
    service = make_service(tiers=("dram",), tier_budget_bytes=int(2.5 * size), placement_policy=policy,
                           data_dir=tmp_path / "service")

    async def scenario():
        ids = [(await service.create(None, None)).id for _ in range(3)]
        await service.set_retention(ids[0], {"pinned": True})
        for session in ids:
            await _turn(service, session)
            await service.offload(session)
        assert [(await service.view(s)).tier for s in ids] == ["dram", None, "dram"]

    asyncio.run(scenario())


def test_a_ttl_drops_the_stored_kv_not_the_history(make_service):
    service = make_service(tiers=("dram",))
    policy = service.placement_policy
    now = [1_000_000.0]
    policy.clock = lambda: now[0]

    async def scenario():
        session = (await service.create(None, None, retention={"ttl_seconds": 60})).id
        await _turn(service, session)
        await service.offload(session)
        now[0] += 59
        await service.retention.expire()
        assert (await service.view(session)).tier == "dram"
        now[0] += 2
        await service.retention.expire()
        view = await service.view(session)
        assert view.tier is None and view.turns == 1 and view.retention["ttl_seconds"] == 60
        result = await _turn(service, session)
        assert result.restore_source == "recompute" and (await service.view(session)).turns == 2
        assert service.stats()["placement"]["expired"] == 1

    asyncio.run(scenario())


def test_a_conversations_own_settings_override_its_tenants_field_by_field(make_service):
    service = make_service(tenant_retention={"*": {"priority": "low", "ttl_seconds": 600},
                                             "acme": {"priority": "high"}})

    async def scenario():
        acme = (await service.create(None, None, tenant="acme", retention={"pinned": True})).id
        other = (await service.create(None, None, tenant="other")).id
        assert (await service.view(acme, "acme")).retention == {"pinned": True, "priority": "high", "ttl_seconds": 600}
        assert (await service.view(other, "other")).retention == {"pinned": False, "priority": "low",
                                                                   "ttl_seconds": 600}
        view = await service.set_retention(acme, None, "acme")  # its own settings cleared: the tenant's apply
        assert view.retention == {"pinned": False, "priority": "high", "ttl_seconds": 600}
        with pytest.raises(InvalidRequest):
            await service.set_retention(acme, {"priority": "urgent"}, "acme")
        assert service.history.load(acme).retention is None  # the refused change wrote nothing

    asyncio.run(scenario())


def test_a_tenants_defaults_changed_at_run_time_reach_its_stored_conversations(make_service, tmp_path):
    """A TTL set for a tenant after its conversation went idle drops that conversation's stored KV; one with
    its own TTL, and another tenant's, keep theirs. A service reopened on the same store starts with it."""
    service = make_service(tiers=("dram",), data_dir=tmp_path / "data")
    policy = service.placement_policy
    now = [1_000_000.0]
    policy.clock = lambda: now[0]

    async def scenario():
        plain = (await service.create(None, None, tenant="acme")).id
        own = (await service.create(None, None, tenant="acme", retention={"ttl_seconds": 7200})).id
        other = (await service.create(None, None, tenant="beta")).id
        for session, tenant in ((plain, "acme"), (own, "acme"), (other, "beta")):
            await _turn(service, session, tenant)
            await service.offload(session, tenant)
        applies = await service.set_tenant_retention("acme", {"ttl_seconds": 600, "priority": "high"})
        assert (applies.ttl_seconds, applies.priority) == (600, "high")
        assert (await service.view(plain, "acme")).retention == {"pinned": False, "priority": "high",
                                                                  "ttl_seconds": 600}
        now[0] += 601
        await service.sweep()
        tiers = [(await service.view(session, tenant)).tier
                 for session, tenant in ((plain, "acme"), (own, "acme"), (other, "beta"))]
        assert tiers == [None, "dram", "dram"]
        with pytest.raises(InvalidRequest):
            await service.set_tenant_retention("acme", {"ttl_seconds": 1})
        await service.stop()

    asyncio.run(scenario())
    reopened = make_service(tiers=("dram",), data_dir=tmp_path / "data")

    async def after_restart():
        await reopened.retention.refresh()
        assert reopened.retention.tenant_defaults == {"acme": {"ttl_seconds": 600, "priority": "high"}}
        cleared = await reopened.set_tenant_retention("acme", None)
        assert cleared.ttl_seconds is None and reopened.history.tenant_retention() == {}

    asyncio.run(after_restart())


def test_a_tenants_ttl_set_after_a_restart_reaches_its_stored_conversations(make_service, tmp_path):
    """A restarted service adopts the stored blobs before it hears of their conversations: a tenant's new TTL
    still finds them (by the history's tenant, not the policy's books)."""
    first = make_service(tiers=("lmdb",), data_dir=tmp_path / "data")

    async def before():
        session = (await first.create(None, None, tenant="acme")).id
        await _turn(first, session, "acme")
        await first.offload(session, "acme")
        await first.stop()
        return session

    session = asyncio.run(before())
    first.close()
    service = make_service(tiers=("lmdb",), data_dir=tmp_path / "data")
    later = time.time() + 601
    policy = service.placement_policy

    async def after():
        assert (await service.view(session, "acme")).tier == "lmdb"
        await service.set_tenant_retention("acme", {"ttl_seconds": 600})
        policy.clock = lambda: later
        await service.sweep()
        assert (await service.view(session, "acme")).tier is None

    asyncio.run(after())


def test_a_sweep_goes_on_when_a_shared_history_cannot_be_read(make_service, monkeypatch):
    service = make_service(tiers=("dram",))
    monkeypatch.setattr(service.history, "is_shared", True)

    def down():
        raise ConnectionError("the history is down")

    monkeypatch.setattr(service.history, "tenant_retention", down)

    async def scenario():
        await service.sweep()  # logged, not raised: the TTL expiry and the rest of the sweep still run
        assert service.retention.tenant_defaults == {}

    asyncio.run(scenario())


@pytest.mark.parametrize("placement_policy", ["lru", "value"])
def test_a_ttl_longer_than_a_week_still_drops_the_stored_kv(make_service, placement_policy):
    """The policies forget a conversation away a week that holds nothing in their books; LRU books no blob, so it
    forgot every one, and with it the TTL due later: a 30-day TTL never fired and the KV stayed for good."""
    service = make_service(tiers=("dram",), placement_policy=placement_policy)
    policy, now, day = service.placement_policy, [1_000_000.0], 86_400.0
    policy.clock = lambda: now[0]

    async def scenario():
        session = (await service.create(None, None, retention={"ttl_seconds": int(30 * day)})).id
        await _turn(service, session)
        await service.offload(session)
        now[0] += 8 * day
        await service.retention.expire()
        assert (await service.view(session)).tier == "dram"
        now[0] += 23 * day
        await service.retention.expire()
        assert (await service.view(session)).tier is None

    asyncio.run(scenario())
