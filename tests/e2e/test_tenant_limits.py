"""Per-tenant limits (issue 15), over HTTP with API keys: conversations held, stored bytes, requests per
minute and turns at once each answer 429 with Retry-After past the limit, for that tenant only, and the
admin sees the limits and every tenant's use."""

import time

import httpx
import openai
import pytest

from statekeeper.tenancy import TenantLimits
from benchmarks.harness.live_server import live_server

ADMIN = "admin-token-0123456789abcdef"


@pytest.fixture
def serve(make_service, monkeypatch):
    def start(step_seconds: float = 0.0, **limits):
        service = make_service(tenant_limits=TenantLimits(**limits))
        if step_seconds:  # a model slow enough that a turn is still under way when the next request comes
            step = service.worker.step
            monkeypatch.setattr(service.worker, "step", lambda *args: time.sleep(step_seconds) or step(*args))
        return live_server(service, admin_token=ADMIN, auth="api_key")

    return start


def _keys(url: str, *tenants: str) -> list[dict]:
    headers = []
    for tenant in tenants:
        response = httpx.post(f"{url}/v1/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert response.status_code == 201, response.text
        headers.append({"Authorization": f"Bearer {response.json()['key']}"})
    return headers


def _refused(response: httpx.Response) -> bool:
    return response.status_code == 429 and int(response.headers["Retry-After"]) >= 1


def _usage(url: str) -> dict:
    answer = httpx.get(f"{url}/v1/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return {"limits": answer["limits"]} | {row["tenant"]: row for row in answer["data"]}


def test_a_tenant_at_its_conversation_limit_gets_429_until_it_deletes_one(serve):
    with serve(sessions=2) as url:
        acme, globex = _keys(url, "acme", "globex")
        first, _ = [httpx.post(f"{url}/v1/sessions", json={}, headers=acme).json()["id"] for _ in range(2)]
        assert _refused(httpx.post(f"{url}/v1/sessions", json={}, headers=acme))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=acme["Authorization"][7:], max_retries=0)
        with pytest.raises(openai.RateLimitError):  # a new conversation through the OpenAI API is one too
            model = client.models.list().data[0].id
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert httpx.post(f"{url}/v1/sessions", json={}, headers=globex).status_code == 201  # per tenant
        usage = _usage(url)
        assert usage["limits"]["sessions"] == 2 and (usage["acme"]["sessions"], usage["globex"]["sessions"]) == (2, 1)
        assert httpx.delete(f"{url}/v1/sessions/{first}", headers=acme).status_code == 204
        assert httpx.post(f"{url}/v1/sessions", json={}, headers=acme).status_code == 201


def test_a_tenant_over_its_stored_bytes_gets_429_for_new_work_until_it_deletes(serve):
    with serve(stored_bytes=1) as url:
        acme, globex = _keys(url, "acme", "globex")
        session = httpx.post(f"{url}/v1/sessions", json={}, headers=acme).json()["id"]
        turn = {"content": "Hello there.", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/sessions/{session}/messages", json=turn, headers=acme).status_code == 200
        assert httpx.post(f"{url}/v1/sessions/{session}/offload", headers=acme).status_code == 200
        stored = _usage(url)["acme"]["stored_bytes"]
        assert stored == httpx.get(f"{url}/v1/sessions/{session}", headers=acme).json()["stored_bytes"] > 0
        assert _refused(httpx.post(f"{url}/v1/sessions", json={}, headers=acme))
        assert _refused(httpx.post(f"{url}/v1/sessions/{session}/messages", json=turn, headers=acme))
        assert len(httpx.get(f"{url}/v1/sessions/{session}/messages", headers=acme).json()["data"]) == 2  # kept
        other = httpx.post(f"{url}/v1/sessions", json={}, headers=globex).json()["id"]
        assert httpx.post(f"{url}/v1/sessions/{other}/messages", json=turn, headers=globex).status_code == 200
        assert httpx.delete(f"{url}/v1/sessions/{session}", headers=acme).status_code == 204
        assert "acme" not in _usage(url)  # nothing held any more
        assert httpx.post(f"{url}/v1/sessions", json={}, headers=acme).status_code == 201


def test_requests_past_a_tenants_rate_get_429_with_the_wait(serve):
    with serve(requests_per_minute=3) as url:
        acme, globex = _keys(url, "acme", "globex")
        assert [httpx.get(f"{url}/v1/models", headers=acme).status_code for _ in range(3)] == [200] * 3
        refused = httpx.get(f"{url}/v1/models", headers=acme)
        assert _refused(refused) and int(refused.headers["Retry-After"]) <= 60
        assert refused.json()["error"]["type"] == "rate_limit_error"  # OpenAI's shape on an OpenAI path
        assert httpx.get(f"{url}/v1/models", headers=globex).status_code == 200
        assert _usage(url)["limits"]["requests_per_minute"] == 3


def test_a_tenants_turns_past_its_concurrency_get_429_while_others_run(serve):
    with serve(concurrent_turns=1, step_seconds=0.02) as url:
        acme, globex = _keys(url, "acme", "globex")
        sessions = [httpx.post(f"{url}/v1/sessions", json={}, headers=h).json()["id"] for h in (acme, acme, globex)]
        long_turn = {"content": "Tell me a long story.", "max_tokens": 100, "temperature": 0, "stream": True}
        short_turn = {"content": "Hi.", "max_tokens": 2}
        with httpx.Client(timeout=60) as client, client.stream(
                "POST", f"{url}/v1/sessions/{sessions[0]}/messages", json=long_turn, headers=acme) as running:
            lines = running.iter_lines()  # held: a dropped iterator closes the stream, which ends the turn
            next(lines)  # the turn is under way
            assert _refused(client.post(f"{url}/v1/sessions/{sessions[1]}/messages", json=short_turn, headers=acme))
            assert _usage(url)["acme"]["turns_in_progress"] == 1
            assert client.post(f"{url}/v1/sessions/{sessions[2]}/messages", json=short_turn, headers=globex).status_code == 200
            assert list(lines)[-2].endswith('"done": true}')  # the long turn was not disturbed
        assert httpx.post(f"{url}/v1/sessions/{sessions[1]}/messages", json=short_turn, headers=acme).status_code == 200


def test_a_streamed_first_turn_whose_client_leaves_leaves_no_conversation_behind(serve):
    """A client that streams a new conversation's first turn and goes away mid-reply ("stop generating" on the
    first message) never learnt the conversation's id: the service deletes it again. Under uvicorn the
    disconnect cancels the request's scope, which cancelled that cleanup's own history call, so the conversation
    stayed, counted against the tenant's conversation limit for good."""
    with serve(sessions=1, step_seconds=0.02) as url:
        (acme,) = _keys(url, "acme")
        model = httpx.get(f"{url}/v1/models", headers=acme).json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 200, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=acme) as response:
                assert response.status_code == 200
                next(response.iter_lines())  # the reply has begun; leaving the block disconnects
        deadline = time.monotonic() + 10
        while "acme" in _usage(url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "acme" not in _usage(url)
        answer = httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": False, "max_tokens": 2}, headers=acme)
        assert answer.status_code == 200
