"""What a web page in the user's browser can make a development service (no API keys, on loopback) do
(api/browser_guard.py): a page rebound to 127.0.0.1 sends its own Host name, a page of another site sends
its Origin, and a body a page can send without a CORS preflight is not JSON. Through a live server, as the
browser's requests would arrive."""

import httpx
import pytest

from statekeeper.settings import Settings
from benchmarks.harness.live_server import live_server

SERVED = ("127.0.0.1", "localhost", "::1")


@pytest.fixture
def url(make_service):
    with live_server(make_service(), allowed_hosts=SERVED) as url:
        yield url



def test_a_rebound_host_name_is_refused_and_changes_nothing(url):
    before = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
    for method, path, body in (("POST", "/v1/sessions", {}), ("GET", f"/v1/sessions/{before}/messages", None),
                               ("POST", f"/v1/sessions/{before}/messages", {"content": "hi", "max_tokens": 2}),
                               ("DELETE", f"/v1/sessions/{before}", None)):
        response = httpx.request(method, url + path, json=body, headers={"Host": "attacker.example:8000"})
        assert response.status_code == 400 and "Host" in response.json()["detail"], (method, path)
    assert httpx.get(f"{url}/v1/sessions/{before}").json()["turns"] == 0


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST"])
def test_the_loopback_names_are_served(url, host):
    port = url.rsplit(":", 1)[1]
    assert httpx.get(f"{url}/healthz", headers={"Host": f"{host}:{port}"}).status_code == 200


def test_host_and_origin_headers_that_do_not_parse_are_refused_not_a_500(url):
    port = url.rsplit(":", 1)[1]
    assert httpx.get(f"{url}/healthz", headers={"Host": f"[::1:{port}"}).status_code == 400
    response = httpx.post(f"{url}/v1/sessions", json={}, headers={"Origin": "http://[::1"})
    assert response.status_code == 403


def test_a_page_of_another_site_cannot_change_anything(url):
    session = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
    for origin in ("https://attacker.example", "null", "http://127.0.0.1:1"):
        headers = {"Origin": origin}
        assert httpx.post(f"{url}/v1/sessions/{session}/offload", headers=headers).status_code == 403
        assert httpx.delete(f"{url}/v1/sessions/{session}", headers=headers).status_code == 403
    assert httpx.get(f"{url}/v1/sessions/{session}").status_code == 200
    same_site = {"Origin": url}  # the dashboard's own page
    assert httpx.post(f"{url}/v1/sessions/{session}/offload", headers=same_site).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None])
def test_a_body_that_is_not_sent_as_json_is_refused_with_415(url, content_type):
    session = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(f"{url}/v1/sessions/{session}/messages", content=b'{"content": "hi", "max_tokens": 2}',
                          headers=headers)
    assert response.status_code == 415
    openai = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "m", "messages": []}', headers=headers)
    assert openai.status_code == 415 and openai.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/v1/sessions/{session}").json()["turns"] == 0


def test_json_with_a_charset_or_a_json_suffix_is_taken(url):
    for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
        assert httpx.post(f"{url}/v1/sessions", content=b"{}", headers={"Content-Type": content_type}).status_code == 201


def test_the_development_settings_serve_the_listen_address_and_the_loopback_names(tmp_path, monkeypatch):
    monkeypatch.setenv("STATEKEEPER_ALLOWED_HOSTS", "devbox.lan, other.lan")
    config = Settings(data_dir=tmp_path, host="127.0.0.2").to_config()
    assert config.auth == "none"
    assert set(config.allowed_hosts) == {"127.0.0.2", "localhost", "127.0.0.1", "::1", "devbox.lan", "other.lan"}
    assert Settings(data_dir=tmp_path, host="127.0.0.1", auth="api_key").to_config().allowed_hosts is None
