"""API keys and tenants (issue 15), over HTTP against the service under uvicorn with AUTH=api_key: every
/v1 route wants a key, another tenant's conversations answer 404 as if they did not exist, identical
prompts from two tenants never share a stored state, and a revoked key stops working at once."""

import httpx
import openai
import pytest

from benchmarks.harness.live_server import live_server

ADMIN = "admin-token-0123456789abcdef"


@pytest.fixture
def server(make_service):
    service = make_service()
    with live_server(service, admin_token=ADMIN, auth="api_key") as url:
        yield url


def _key(url: str, tenant: str) -> str:
    response = httpx.post(f"{url}/v1/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 201, response.text
    return response.json()["key"]


def _as(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _openai(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_every_route_wants_a_valid_key(server):
    for method, path in [("POST", "/v1/sessions"), ("GET", "/v1/sessions/abc"), ("GET", "/v1/models")]:
        for headers in ({}, _as("sk-abcdefgh.0123456789abcdef0123456789abcdef"), _as(ADMIN)):
            assert httpx.request(method, f"{server}{path}", headers=headers, json={}).status_code == 401
    with pytest.raises(openai.AuthenticationError) as refused:
        _openai(server, "sk-wrong").chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["code"] == "invalid_api_key"
    assert httpx.get(f"{server}/healthz").status_code == 200  # the probe needs no key


def test_another_tenants_conversation_is_not_found(server):
    acme, globex = _key(server, "acme"), _key(server, "globex")
    session = httpx.post(f"{server}/v1/sessions", json={}, headers=_as(acme)).json()["id"]
    turn = {"content": "Hello there.", "max_tokens": 3}
    assert httpx.post(f"{server}/v1/sessions/{session}/messages", json=turn, headers=_as(acme)).status_code == 200
    scored = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    attempts = [("GET", "", None), ("GET", "/messages", None), ("POST", "/messages", turn), ("POST", "/score", scored),
                ("POST", "/offload", None), ("POST", "/prefetch", None), ("DELETE", "", None)]
    missing = httpx.get(f"{server}/v1/sessions/nosuchsession0000000000000000000", headers=_as(globex))
    for method, suffix, body in attempts:
        response = httpx.request(method, f"{server}/v1/sessions/{session}{suffix}", json=body, headers=_as(globex))
        assert response.status_code == 404, (method, suffix, response.text)
        assert response.json()["detail"].replace(session, "ID") == missing.json()["detail"].replace(
            "nosuchsession0000000000000000000", "ID")  # the same answer as for no session at all
    assert httpx.get(f"{server}/v1/sessions/{session}/messages", headers=_as(acme)).json()["data"][0]["content"] == \
        "Hello there."  # untouched by the other tenant's attempts


def test_identical_prompts_from_two_tenants_never_share_a_stored_state(server):
    clients = {tenant: _openai(server, _key(server, tenant)) for tenant in ("acme", "globex")}
    messages = [{"role": "user", "content": "Tell me about the history of Rome."}]
    model = clients["acme"].models.list().data[0].id
    first = clients["acme"].chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And of Greece?"}]
    ours = clients["acme"].chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6)
    theirs = clients["globex"].chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=6)
    assert ours.usage.prompt_tokens_details.cached_tokens > 0
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0  # nothing of acme's state reached globex
    assert theirs.statekeeper["conversation_id"] != ours.statekeeper["conversation_id"]


def test_a_revoked_key_stops_working_at_once(server):
    key = _key(server, "acme")
    assert httpx.post(f"{server}/v1/sessions", json={}, headers=_as(key)).status_code == 201
    key_id = key[3:11]
    listed = httpx.get(f"{server}/v1/admin/keys", headers=_as(ADMIN)).json()["data"]
    assert [(k["key_id"], k["tenant"], k["revoked"]) for k in listed] == [(key_id, "acme", False)]
    assert all(key not in str(k) for k in listed)  # the key itself is shown once, at creation
    assert httpx.delete(f"{server}/v1/admin/keys/{key_id}", headers=_as(ADMIN)).status_code == 204
    assert httpx.post(f"{server}/v1/sessions", json={}, headers=_as(key)).status_code == 401
    assert httpx.delete(f"{server}/v1/admin/keys/nokey123", headers=_as(ADMIN)).status_code == 404


def test_another_tenants_response_is_not_found(server):
    acme, globex = (_openai(server, _key(server, tenant)) for tenant in ("acme", "globex"))
    model = acme.models.list().data[0].id
    response = acme.responses.create(model=model, input="Hello there.", temperature=0, max_output_tokens=3)
    for attempt in (lambda: globex.responses.retrieve(response.id), lambda: globex.responses.delete(response.id),
                    lambda: globex.responses.create(model=model, input="And?", previous_response_id=response.id,
                                                    max_output_tokens=3)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert acme.responses.retrieve(response.id).output_text == response.output_text  # untouched
