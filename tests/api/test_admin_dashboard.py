"""The admin dashboard's API (issue 16): its conversation table (paged by id prefix over every tenant),
the table's actions, the charts' stats history, and the page's static files."""

import time

from fastapi.testclient import TestClient

from api.app import create_app
from statekeeper.dashboard import StatsHistory
from statekeeper.history import Conversation

TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_history_pages_by_prefix_and_after(tmp_path):
    from statekeeper.history import LmdbHistory
    store = LmdbHistory(tmp_path / "h")
    ids = ["aa1", "aa2", "aa3", "ab1", "b1"]
    store.save_many([Conversation(id=i, created_at="now") for i in ids])
    store.check_writable()
    assert store.page() == ids
    assert store.page("aa") == ["aa1", "aa2", "aa3"]
    assert store.page("aa", after="aa1", limit=1) == ["aa2"]
    assert store.page("aa", after="aa3") == []
    assert store.page("", after="ab1") == ["b1"]
    assert store.page("a", after="0") == ["aa1", "aa2", "aa3", "ab1"]  # an `after` before the prefix
    assert store.page("c") == []
    store.close()


def test_conversations_table_and_its_actions(make_service):
    service = make_service()
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        ids = sorted(client.post("/v1/sessions", json={}).json()["id"] for _ in range(3))
        for session in ids:
            client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        assert client.get("/v1/admin/conversations").status_code == 401
        page = client.get("/v1/admin/conversations?limit=2", headers=ADMIN).json()
        assert [row["id"] for row in page["data"]] == ids[:2] and page["next_after"] == ids[1]
        rest = client.get(f"/v1/admin/conversations?limit=2&after={ids[1]}", headers=ADMIN).json()
        assert [row["id"] for row in rest["data"]] == ids[2:] and rest["next_after"] is None
        found = client.get(f"/v1/admin/conversations?prefix={ids[0][:10]}", headers=ADMIN).json()["data"]
        assert [row["id"] for row in found] == [ids[0]]
        row = found[0]
        assert row["state"] == "active" and row["tier"] is None and row["tokens"] > 0 and row["last_active"]

        assert client.post(f"/v1/admin/conversations/{ids[0]}/offload").status_code == 401
        row = client.post(f"/v1/admin/conversations/{ids[0]}/offload", headers=ADMIN).json()
        assert row["state"] == "inactive" and row["tier"] == "dram" and row["stored_bytes"] > 0
        assert row["codec"] == "none"
        row = client.post(f"/v1/admin/conversations/{ids[0]}/prefetch", headers=ADMIN).json()
        assert row["tier"] == "dram"
        assert client.delete(f"/v1/admin/conversations/{ids[0]}", headers=ADMIN).status_code == 204
        assert client.delete(f"/v1/admin/conversations/{ids[0]}", headers=ADMIN).status_code == 404
        assert client.post("/v1/admin/conversations/nope/offload", headers=ADMIN).status_code == 404
        assert [r["id"] for r in client.get("/v1/admin/conversations", headers=ADMIN).json()["data"]] == ids[1:]


def test_stats_history_is_bounded_and_charts_every_series(make_service):
    history = StatsHistory(interval_s=5, window_s=20)
    stats = {"tiers": [{"name": "dram", "usage_bytes": 10}], "compression": {"raw_bytes": 0, "stored_bytes": 0},
             "model_thread": {"live_queued": 1, "background_queued": 2}}
    history.record_turn("dram", 4.0)
    history.record_turn("recompute", 10.0)
    first = history.sample(stats, now=100.0)
    assert first["ttft_ms"] == {"dram": [4.0, 4.0], "recompute": [10.0, 10.0]} and first["hit_rate"] == 0.5
    assert first["restores_per_s"] == {"dram": 0.2, "recompute": 0.2} and first["queue_depth"] == 3
    assert first["compression_ratio"] == 1.0 and first["tier_bytes"] == {"dram": 10}
    for t in range(10):
        history.sample(stats, now=105.0 + 5 * t)
    report = history.report()
    assert len(report["samples"]) == 4 and report["samples"][-1]["hit_rate"] is None  # no turns: no rate

    service = make_service(dashboard_sample_seconds=0.1)
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            body = client.get("/v1/admin/history", headers=ADMIN).json()
            if any(sample["ttft_ms"] for sample in body["samples"]):
                break
            time.sleep(0.1)
        assert any(sample["ttft_ms"].get("active") for sample in body["samples"])
        assert body["codecs"] == {"dram": "none", "lmdb": "none"}
        assert client.get("/v1/admin/history").status_code == 401


def test_the_dashboard_page_is_served_without_data(make_service):
    service = make_service()
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        assert client.get("/admin", follow_redirects=False).status_code in (301, 302, 307)
        # The page's options go with the redirect (?poll_ms= was dropped: it polled every 3 s whatever it said).
        assert client.get("/admin?poll_ms=500", follow_redirects=False).headers["location"] == "/admin/?poll_ms=500"
        page = client.get("/admin/")
        assert page.status_code == 200 and "Admin token required" in page.text
        assert "https://" not in page.text  # nothing from a CDN
        assert client.get("/admin/vendor/uPlot.iife.min.js").status_code == 200
        assert client.get("/admin/dashboard.js").status_code == 200


def test_the_dashboard_api_pages_10000_conversations(make_service):
    service = make_service()
    service.history.save_many([Conversation(id=f"c{i:05d}", created_at="2025-01-01T00:00:00Z", tokens=[1] * 64,
                                            messages=[{"role": "user", "content": "hi " * 20}])
                               for i in range(10_000)])
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        # Each answers from a range scan of one page (how fast: benchmarks/dashboard_api.py, BENCHMARKS.md).
        for path in ("/v1/admin/tiers", "/v1/admin/history", "/v1/admin/conversations?limit=25",
                     "/v1/admin/conversations?prefix=c09&limit=25", "/v1/admin/conversations?after=c05000&limit=25"):
            assert client.get(path, headers=ADMIN).status_code == 200, path
        assert len(client.get("/v1/admin/conversations?limit=25", headers=ADMIN).json()["data"]) == 25


def test_the_admin_moves_a_stored_state_to_a_chosen_tier(make_service):
    """The table's "move to tier": the blob leaves one tier for the other whole, and the next turn restores
    from where it went as it would have from where it was."""
    service = make_service(tiers=("dram", "lmdb"))
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        stored = client.post(f"/v1/admin/conversations/{session}/offload", headers=ADMIN).json()
        assert stored["tier"] == "dram"
        move = f"/v1/admin/conversations/{session}/move"
        assert client.post(move, json={"tier": "lmdb"}).status_code == 401
        moved = client.post(move, json={"tier": "lmdb"}, headers=ADMIN).json()
        assert moved["tier"] == "lmdb" and moved["stored_bytes"] == stored["stored_bytes"]
        tiers = {tier["name"]: tier["blobs"] for tier in client.get("/v1/admin/tiers", headers=ADMIN).json()["tiers"]}
        assert tiers == {"dram": 0, "lmdb": 1}
        assert client.post(move, json={"tier": "redis"}, headers=ADMIN).status_code == 422  # not a tier here
        assert client.post("/v1/admin/conversations/nope/move", json={"tier": "lmdb"}, headers=ADMIN).status_code == 404
        turn = client.post(f"/v1/sessions/{session}/messages", json={"content": "And?", "max_tokens": 3}).json()
        assert turn["restore"]["source"] == "lmdb" and turn["usage"]["cached_tokens"] > 0


def test_last_active_is_the_last_turn_also_for_a_conversation_not_in_memory(make_service):
    import asyncio
    from datetime import datetime, timezone

    from statekeeper.sessions import TurnRequest

    service = make_service(tiers=("dram",), max_idle_sessions=0)

    async def scenario():
        session = (await service.create(None, None)).id
        before = datetime.now(timezone.utc)
        async for _ in service.turn(session, TurnRequest("Hello there.", max_tokens=3)):
            pass
        await service.offload(session)
        await service.sweep()  # idle and over the limit: it leaves memory
        assert service.stats()["sessions_in_memory"] == 0
        return before, (await service.readouts.conversation_rows())[0]

    before, row = asyncio.run(scenario())
    assert row["last_active"] is not None
    assert datetime.fromisoformat(row["last_active"]) >= before.replace(microsecond=0)


def test_a_move_to_a_tier_that_cannot_take_the_blob_leaves_it_where_it_was(make_service):
    """Moving a stored state to a tier that is down (Redis unreachable) keeps it in its tier: it was
    dropped, and the next turn recomputed its whole history."""
    from benchmarks.harness.redis_server import free_port

    service = make_service(tiers=("dram", "redis"), redis_url=f"redis://127.0.0.1:{free_port()}/0")
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        stored = client.post(f"/v1/admin/conversations/{session}/offload", headers=ADMIN).json()
        assert stored["tier"] == "dram"
        moved = client.post(f"/v1/admin/conversations/{session}/move", json={"tier": "redis"}, headers=ADMIN)
        assert moved.status_code == 200
        assert moved.json()["tier"] == "dram" and moved.json()["stored_bytes"] == stored["stored_bytes"]
        turn = client.post(f"/v1/sessions/{session}/messages", json={"content": "And?", "max_tokens": 3}).json()
        assert turn["restore"]["source"] == "dram" and turn["usage"]["cached_tokens"] > 0


def test_the_admin_looking_at_a_stored_state_reads_it_without_a_trace(make_service):
    """The table and an action's answer show a stored blob's codec, read from its header where the service does
    not remember it: that read counted a hit, moved the blob up the LRU order and, with PROMOTE_ON_READ, promoted
    it, so a move to a slower tier came straight back in the move's own answer."""
    service = make_service(tiers=("dram", "lmdb"))
    service.tiers.promote_on_read = True  # PROMOTE_ON_READ=true
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        assert client.post(f"/v1/admin/conversations/{session}/offload", headers=ADMIN).json()["tier"] == "dram"

        def counts():
            return {tier["name"]: (tier["hits"], tier["promotions"])
                    for tier in client.get("/v1/admin/tiers", headers=ADMIN).json()["tiers"]}

        before = counts()
        moved = client.post(f"/v1/admin/conversations/{session}/move", json={"tier": "lmdb"}, headers=ADMIN).json()
        assert moved["tier"] == "lmdb" and moved["codec"] is not None
        rows = client.get("/v1/admin/conversations", headers=ADMIN).json()["data"]
        assert [(row["tier"], row["codec"]) for row in rows] == [("lmdb", moved["codec"])]
        assert counts() == before


def test_last_active_stays_the_last_turn_when_a_conversation_is_loaded_without_one(make_service):
    """A conversation loaded into memory without a turn (the admin's prefetch or move, a client reading it)
    showed "last active: just now", the time it was loaded; it is still its last turn's."""
    import asyncio

    from statekeeper.sessions import TurnRequest

    service = make_service(tiers=("dram",), max_idle_sessions=0)

    async def scenario():
        session = (await service.create(None, None)).id
        async for _ in service.turn(session, TurnRequest("Hello there.", max_tokens=3)):
            pass
        await service.offload(session)
        await service.sweep()  # idle and over the limit: it leaves memory
        before = (await service.readouts.conversation_rows())[0]["last_active"]
        await asyncio.sleep(1.1)  # a later second, as the rows show them
        await service.prefetch(session)  # loads it again
        assert service.in_memory(session) is not None
        return before, (await service.readouts.conversation_rows())[0]["last_active"]

    before, after = asyncio.run(scenario())
    assert after == before


def test_a_page_with_a_conversation_deleted_meanwhile_still_leads_to_the_next(make_service, monkeypatch):
    """A conversation of the page deleted between the listing and its load drops out of the page: the page then
    looked like the last one (no next_after) though more conversations followed."""
    service = make_service()
    ids = ["c1", "c2", "c3", "c4"]
    service.history.save_many([Conversation(id=i, created_at="2025-01-01T00:00:00Z") for i in ids])
    load = service.history.load
    monkeypatch.setattr(service.history, "load", lambda i: None if i == "c1" else load(i))  # deleted meanwhile
    shown, after = [], ""
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        for _ in range(len(ids)):  # Next, while the page offers it
            page = client.get(f"/v1/admin/conversations?limit=2&after={after}", headers=ADMIN).json()
            assert len(page["data"]) <= 2
            shown += [row["id"] for row in page["data"]]
            if page["next_after"] is None:
                break
            after = page["next_after"]
    assert shown == ["c2", "c3", "c4"]
