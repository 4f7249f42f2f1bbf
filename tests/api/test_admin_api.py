import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from statekeeper.config import CompressionConfig
from tests.utils.compression import wait_until_compressed

TOKEN = "admin-token-0123456789"


@pytest.fixture
def make_client(make_service):
    def make(token):
        service = make_service()
        return TestClient(create_app(lambda: service, admin_token=token))

    return make


def test_tier_stats_need_the_admin_token(make_client):
    with make_client(TOKEN) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
        client.post(f"/v1/sessions/{session}/offload")
        assert client.get("/v1/admin/tiers").status_code == 401
        assert client.get("/v1/admin/tiers", headers={"Authorization": "Bearer wrong"}).status_code == 401
        response = client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {TOKEN}"})
        assert response.status_code == 200
        body = response.json()
        dram = body["tiers"][0]
        assert dram["name"] == "dram" and dram["blobs"] == 1 and dram["usage_bytes"] > 0 and dram["available"]
        assert {"hits", "misses", "promotions", "demotions", "evictions", "errors", "budget_bytes"} <= dram.keys()
        assert body["active_sessions"] == 0 and body["sessions_in_memory"] == 1
        # What the service holds against its bounds, and the freed memory it gave back to the kernel.
        assert body["memory"]["freed_given_back_bytes"] >= 0 and body["memory"]["idle_sessions"]["count"] == 1
        # The live KV dtype and why (no start-up profile in this test: KV_DTYPE's rule, not measured).
        assert body["kv_dtype"]["reason"] and body["kv_dtype"]["dtype"] in ("float32", "bfloat16", "float16")
        heap = body["memory"]["heap"]  # glibc's allocator: what is in use and what it keeps freed
        assert heap is None or heap["in_use"] > 0 and heap["free_held"] >= 0


@pytest.mark.parametrize("long_lane", ["on", "off"])
def test_tier_stats_report_the_long_lanes_work_where_there_is_one(make_service, long_lane):
    """The long lane runs long prompts and next turns' background prefills beside the model thread: where its
    time went was in the service's stats and dropped from the admin API's answer."""
    service = make_service(long_prefill_lane=long_lane)
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        long_prompt = "Tell me about Rome. " * 80  # past one prefill chunk: on the long lane, where there is one
        client.post(f"/v1/sessions/{session}/messages", json={"content": long_prompt, "max_tokens": 3})
        body = client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    if long_lane == "off":
        assert body["long_prefill_lane"] is None
    else:
        lane = body["long_prefill_lane"]
        assert lane["live_jobs"] >= 1 and lane["live_seconds"] > 0 and lane["live_wait_seconds"] >= 0
        assert {"background_seconds", "background_jobs", "live_queued"} <= lane.keys()


def test_admin_api_is_disabled_without_a_token(make_client):
    with make_client(None) as client:
        response = client.get("/v1/admin/tiers", headers={"Authorization": "Bearer anything"})
        assert response.status_code == 403 and "ADMIN_TOKEN" in response.json()["detail"]


def test_tier_stats_report_the_compression_process(make_service):
    service = make_service(compression=CompressionConfig(), compress_after_seconds=0, compress_process=True)
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        client.post(f"/v1/sessions/{session}/messages", json={"content": "Tell me about Rome. " * 20, "max_tokens": 3})
        client.post(f"/v1/sessions/{session}/offload")
        assert wait_until_compressed(client, session)["is_compressed"]
        body = client.get("/v1/admin/tiers", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert body["compression"]["compressed"] == 1 and body["compression"]["process_jobs"] == 1
        assert body["compression"]["process_cpu_seconds"] > 0
        assert body["model_thread"]["background_seconds"] == 0  # the child scored it, not the model thread


def test_the_admin_sets_any_conversations_retention_and_reads_the_tenants_defaults(make_service):
    service = make_service(tenant_retention={"*": {"ttl_seconds": 7200}})
    admin = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        path = f"/v1/admin/conversations/{session}/retention"
        assert client.put(path, json={"pinned": True}).status_code == 401
        answer = client.put(path, json={"pinned": True}, headers=admin)
        assert answer.status_code == 200
        assert answer.json()["retention"] == {"pinned": True, "priority": "normal", "ttl_seconds": 7200}
        assert client.put(path, json={"priority": "someday"}, headers=admin).status_code == 422
        assert client.put(f"/v1/admin/conversations/{'x' * 32}/retention", json={}, headers=admin).status_code == 404
        tenants = client.get("/v1/admin/tenants", headers=admin).json()
        assert tenants["retention"] == {"*": {"pinned": None, "priority": None, "ttl_seconds": 7200}}


def test_the_admin_sets_a_tenants_retention_defaults_at_run_time(make_service):
    service = make_service(tenant_retention={"*": {"ttl_seconds": 7200}})
    admin = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]  # the default tenant's
        assert client.put("/v1/admin/tenants/*/retention", json={"pinned": True}).status_code == 401
        answer = client.put("/v1/admin/tenants/*/retention", json={"pinned": True}, headers=admin)
        assert answer.status_code == 200
        assert answer.json() == {"tenant": "*", "settings": {"pinned": True, "priority": None, "ttl_seconds": None},
                                 "applies": {"pinned": True, "priority": "normal", "ttl_seconds": None}}
        assert client.get(f"/v1/sessions/{session}").json()["retention"]["pinned"] is True
        acme = client.put("/v1/admin/tenants/acme/retention", json={"priority": "low"}, headers=admin).json()
        assert acme["applies"] == {"pinned": True, "priority": "low", "ttl_seconds": None}
        for bad in ({"ttl_seconds": 5}, {"priority": "urgent"}, {"color": "red"}):
            assert client.put("/v1/admin/tenants/acme/retention", json=bad, headers=admin).status_code == 422
        assert client.put("/v1/admin/tenants/-x/retention", json={}, headers=admin).status_code == 422
        tenants = client.get("/v1/admin/tenants", headers=admin).json()
        assert tenants["retention"] == {"*": {"pinned": True, "priority": None, "ttl_seconds": None},
                                        "acme": {"pinned": None, "priority": "low", "ttl_seconds": None}}
        cleared = client.put("/v1/admin/tenants/*/retention", json={}, headers=admin).json()
        assert cleared["applies"] == {"pinned": False, "priority": "normal", "ttl_seconds": 7200}
        assert client.get(f"/v1/sessions/{session}").json()["retention"]["ttl_seconds"] == 7200


def test_the_forecast_replays_the_recent_turns_with_every_tier_scaled(make_client):
    with make_client(TOKEN) as client:
        session = client.post("/v1/sessions", json={}).json()["id"]
        for content in ("Hi", "And then?"):
            client.post(f"/v1/sessions/{session}/messages", json={"content": content, "max_tokens": 3})
        assert client.get("/v1/admin/forecast").status_code == 401
        forecast = client.get("/v1/admin/forecast", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert (forecast["turns"], forecast["conversations"], forecast["policy"]) == (2, 1, "value")
    assert [row["multiple"] for row in forecast["rows"]] == [0.5, 1.0, 2.0, 4.0]
    assert all(row["resumed"] == {"active": 1} and row["hit_rate"] == 1.0 for row in forecast["rows"])
    assert forecast["rows"][0]["tiers"]["dram"] * 2 == forecast["rows"][1]["tiers"]["dram"]


def test_the_forecast_runs_one_at_a_time_and_leaves_the_turns_io_threads_free(make_service, monkeypatch):
    """A forecast replays up to 20,000 turns four times, seconds of Python: it ran on the two I/O threads every
    turn's history and blob calls use, and two admins' forecasts at once held both, every turn's commit waiting.
    It runs apart, one at a time: a second asker gets the running one's answer."""
    import asyncio
    import threading

    from statekeeper.sessions import readouts

    service = make_service(tiers=("dram",))
    release, entered = threading.Event(), []

    def slow_forecast(*args):
        entered.append(args)
        release.wait(10)
        return [{"multiple": 1.0}]

    monkeypatch.setattr(readouts, "forecast", slow_forecast)

    async def scenario():
        asked = [asyncio.create_task(service.readouts.forecast()) for _ in range(2)]
        await asyncio.sleep(0.2)
        io = asyncio.gather(service.in_io_thread(lambda: 1), service.in_io_thread(lambda: 2))
        assert await asyncio.wait_for(io, 2) == [1, 2]  # the turns' I/O threads are free
        release.set()
        first, second = await asyncio.gather(*asked)
        assert len(entered) == 1 and first == second

    asyncio.run(scenario())
