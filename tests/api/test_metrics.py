"""GET /metrics (issue 16): after scripted turns the counters equal what happened, scraping is safe while
turns run, the exposition parses with prometheus-client's own parser and names no conversation."""

import collections
import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.app import create_app
from benchmarks.harness.live_server import live_server

TOKEN = "metrics-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TIER_COUNTERS = ("hits", "misses", "promotions", "demotions", "evictions", "errors")
TIER_GAUGES = ("usage_bytes", "budget_bytes", "blobs")
TURNS = "/v1/sessions/{session_id}/messages"


def scrape(url: str) -> tuple[str, dict]:
    """The exposition's text and its samples, {(name, sorted label pairs): value}."""
    response = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(response.text) for sample in family.samples}
    return response.text, samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def new_session(url: str) -> str:
    response = httpx.post(f"{url}/v1/sessions", json={}, timeout=30)
    assert response.status_code == 201
    return response.json()["id"]


def turn(url: str, session: str, content: str = "Hello, how are you today?") -> dict:
    response = httpx.post(f"{url}/v1/sessions/{session}/messages", json={"content": content, "max_tokens": 3},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def offload(url: str, session: str) -> dict:
    response = httpx.post(f"{url}/v1/sessions/{session}/offload", timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def admin_tiers(url: str) -> dict:
    return httpx.get(f"{url}/v1/admin/tiers", headers=ADMIN, timeout=30).json()


def assert_counts_match(samples: dict, replies: list[dict], tiers: dict) -> None:
    """Turns by source, tokens, and every tier figure, against the replies and GET /v1/admin/tiers."""
    sources = collections.Counter(reply["restore"]["source"] for reply in replies)
    for source in ("active", "dram", "lmdb", "recompute"):
        assert value(samples, "statekeeper_turns_total", source=source) == sources[source], source
        assert value(samples, "statekeeper_ttft_seconds_count", source=source) == sources[source], source
        restored = 0 if source == "active" else sources[source]
        assert value(samples, "statekeeper_restore_seconds_count", source=source) == restored, source
    cached = sum(reply["usage"]["cached_tokens"] for reply in replies)
    prompt = sum(reply["usage"]["prompt_tokens"] for reply in replies)
    assert value(samples, "statekeeper_prompt_tokens_total", kind="cached") == cached
    assert value(samples, "statekeeper_prompt_tokens_total", kind="prefilled") == prompt - cached
    completion = sum(reply["usage"]["completion_tokens"] for reply in replies)
    assert value(samples, "statekeeper_completion_tokens_total") == completion
    assert value(samples, "statekeeper_http_requests_total", route=TURNS, method="POST", status="200") == len(replies)
    for tier in tiers["tiers"]:
        for key in TIER_COUNTERS:
            assert value(samples, f"statekeeper_tier_{key}_total", tier=tier["name"]) == tier[key], (tier["name"], key)
        for key in TIER_GAUGES:
            assert value(samples, f"statekeeper_tier_{key}", tier=tier["name"]) == tier[key], (tier["name"], key)
        assert value(samples, "statekeeper_tier_available", tier=tier["name"]) == 1


def test_counters_equal_what_the_scripted_turns_did(make_service):
    service = make_service()  # dram and lmdb, room for everything
    with live_server(service, admin_token=TOKEN) as url:
        a, b = new_session(url), new_session(url)
        replies = [turn(url, a), turn(url, a)]  # both on the KV in memory
        assert offload(url, a)["tier"] == "dram"
        replies.append(turn(url, a))  # restored from DRAM
        replies.append(turn(url, b))
        offload(url, b)
        replies.append(turn(url, b))
        assert httpx.get(f"{url}/v1/sessions/{'x' * 32}", timeout=30).status_code == 404  # an id that is no one's
        text, samples = scrape(url)
        tiers = admin_tiers(url)

    assert [reply["restore"]["source"] for reply in replies] == ["active", "active", "dram", "active", "dram"]
    assert_counts_match(samples, replies, tiers)
    assert value(samples, "statekeeper_tier_hits_total", tier="dram") == 2
    assert value(samples, "statekeeper_tier_evictions_total", tier="dram") == 0
    assert value(samples, "statekeeper_active_sessions") == 2
    assert value(samples, "statekeeper_active_kv_bytes") == tiers["active_kv_bytes"] > 0
    assert value(samples, "statekeeper_model_thread_jobs_total", priority="live") > 0
    assert value(samples, "statekeeper_http_requests_total", route="/v1/sessions/{session_id}", method="GET",
                 status="404") == 1
    # The placement policy's return-gap model heard of every return: a's two and b's one, within seconds.
    assert value(samples, "statekeeper_placement_returns_total", gap_from_s="0") == 3
    assert sum(v for (name, _), v in samples.items() if name == "statekeeper_placement_returns_total") == 3
    assert value(samples, "statekeeper_placement_returns_within_hour_total") == 3
    assert 0 < value(samples, "statekeeper_placement_predicted_returns_within_hour_total") <= 5
    assert value(samples, "statekeeper_placement_conversations") == 2
    assert value(samples, "statekeeper_placement_expired_total") == 0
    assert value(samples, "statekeeper_placement_compression_ratio") == 8.0  # the prior: nothing compressed
    for secret in (a, b, "x" * 32):  # ids open their conversations: never in a scrape
        assert secret not in text


def test_evictions_and_recomputes_are_counted(make_service, tmp_path):
    # One blob's size, to give the next service's DRAM room for one such blob and not two.
    probe = make_service(tiers=("dram",), data_dir=tmp_path / "probe")
    with live_server(probe, admin_token=TOKEN) as url:
        session = new_session(url)
        turn(url, session)
        blob_bytes = offload(url, session)["stored_bytes"]
    service = make_service(tiers=("dram",), tier_budget_bytes=blob_bytes * 3 // 2, data_dir=tmp_path / "small")
    with live_server(service, admin_token=TOKEN) as url:
        x, y, z = new_session(url), new_session(url), new_session(url)
        replies = [turn(url, x)]
        assert offload(url, x)["stored_bytes"] == blob_bytes
        replies.append(turn(url, y))
        offload(url, y)  # x makes room for it: DRAM is the last tier, so x is evicted
        replies += [turn(url, x), turn(url, y)]  # x recomputes, y is restored from DRAM
        replies.append(turn(url, z, "Tell me about the history of Greece and its city-states. " * 3))
        assert offload(url, z)["tier"] is None  # larger than the tier: stored nowhere
        replies.append(turn(url, z))
        text, samples = scrape(url)
        tiers = admin_tiers(url)

    assert [reply["restore"]["source"] for reply in replies] == [
        "active", "active", "recompute", "dram", "active", "recompute"]
    assert_counts_match(samples, replies, tiers)
    assert value(samples, "statekeeper_tier_evictions_total", tier="dram") == 1
    assert value(samples, "statekeeper_tier_hits_total", tier="dram") == 1
    assert value(samples, "statekeeper_tier_misses_total", tier="dram") == 0
    assert value(samples, "statekeeper_tier_budget_bytes", tier="dram") == blob_bytes * 3 // 2
    for secret in (x, y, z):
        assert secret not in text


def test_scrapes_during_concurrent_turns_never_fail_and_counters_only_grow(make_service):
    service = make_service()
    with live_server(service, admin_token=TOKEN) as url:
        sessions = [new_session(url) for _ in range(4)]
        failures = []

        def converse(session: str) -> None:
            try:
                for _ in range(3):
                    turn(url, session)
                    offload(url, session)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)

        threads = [threading.Thread(target=converse, args=(session,)) for session in sessions]
        for thread in threads:
            thread.start()
        previous, scrapes = {}, 0
        while scrapes < 2 or any(thread.is_alive() for thread in threads):
            _, samples = scrape(url)
            scrapes += 1
            counters = {key: v for key, v in samples.items()
                        if key[0].endswith(("_total", "_count", "_sum", "_bucket"))}
            shrunk = {key: (previous[key], v) for key, v in counters.items() if v < previous.get(key, 0)}
            assert not shrunk
            assert previous.keys() <= counters.keys()  # no series disappears
            previous = counters
        for thread in threads:
            thread.join()
        _, samples = scrape(url)

    assert not failures, failures
    assert value(samples, "statekeeper_turns_total", source="active") == 4
    assert value(samples, "statekeeper_turns_total", source="dram") == 8
    assert value(samples, "statekeeper_tier_hits_total", tier="dram") == 8
    assert value(samples, "statekeeper_model_thread_queue_depth", priority="live") == 0
    assert value(samples, "statekeeper_turns_in_progress") == 0


def test_metrics_need_the_admin_token_unless_public(make_service, tmp_path):
    service = make_service(data_dir=tmp_path / "closed")
    with TestClient(create_app(lambda: service, admin_token=TOKEN)) as client:
        refused = client.get("/metrics")
        assert refused.status_code == 401 and refused.json() == {"detail": "admin token required"}
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/metrics", headers=ADMIN).status_code == 200
        documented = client.get("/openapi.json").json()["paths"]["/metrics"]["get"]["responses"]
        assert list(documented["200"]["content"]) == ["text/plain"]  # the errors are JSON as everywhere else
        assert list(documented["401"]["content"]) == ["application/json"]
    public = make_service(data_dir=tmp_path / "open")
    with TestClient(create_app(lambda: public, admin_token=TOKEN, metrics_public=True)) as client:
        response = client.get("/metrics")
        assert response.status_code == 200 and "statekeeper_turns_total" in response.text


def test_metrics_are_disabled_without_an_admin_token_unless_public(make_service, tmp_path):
    service = make_service(data_dir=tmp_path / "closed")
    with TestClient(create_app(lambda: service)) as client:
        assert client.get("/metrics", headers=ADMIN).status_code == 403
    public = make_service(data_dir=tmp_path / "open")
    with TestClient(create_app(lambda: public, metrics_public=True)) as client:
        assert client.get("/metrics").status_code == 200


def test_requests_answered_before_routing_are_counted_by_their_route_and_unknown_paths_as_unmatched(make_service):
    service = make_service()
    with TestClient(create_app(lambda: service, admin_token=TOKEN, max_body_bytes=100)) as client:
        assert client.post("/v1/sessions", content=b"{}" + b" " * 200,
                           headers={"Content-Type": "application/json"}).status_code == 413
        unknown = "y" * 32
        assert client.get(f"/v2/{unknown}").status_code == 404
        assert client.get("/openapi.json").status_code == 200  # served by FastAPI itself, outside the API's routes
        text = client.get("/metrics", headers=ADMIN).text
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    assert value(samples, "statekeeper_http_requests_total", route="/v1/sessions", method="POST", status="413") == 1
    assert value(samples, "statekeeper_http_requests_total", route="unmatched", method="GET", status="404") == 1
    assert value(samples, "statekeeper_http_requests_total", route="/openapi.json", method="GET", status="200") == 1
    assert unknown not in text


def test_invented_http_methods_add_no_series(make_service):
    """h11 takes any method token, and requests are counted before authentication: a client that invents
    methods must not mint series in the registry. Methods outside HTTP's own are counted as "other"."""
    service = make_service()
    with live_server(service, admin_token=TOKEN) as url:
        for index in range(40):
            httpx.request(f"BREW{index}", f"{url}/v1/sessions")
        httpx.request("PATCH", f"{url}/v1/sessions")
        text, samples = scrape(url)
    methods = {dict(labels)["method"] for name, labels in samples if name == "statekeeper_http_requests_total"}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "other"}
    assert "BREW" not in text
    assert value(samples, "statekeeper_http_requests_total", route="/v1/sessions", method="other", status="405") == 40


def test_the_metrics_token_reads_metrics_and_nothing_else(make_service):
    """What Prometheus holds (docker/prometheus/prometheus.yml): a token that cannot mint API keys."""
    reader = {"Authorization": "Bearer metrics-token-0123456789abcdef"}
    service = make_service()
    with TestClient(create_app(lambda: service, admin_token=TOKEN, metrics_token=reader["Authorization"][7:])) as client:
        assert client.get("/metrics", headers=reader).status_code == 200
        assert client.get("/metrics", headers=ADMIN).status_code == 200
        assert client.get("/metrics", headers={"Authorization": "Bearer metrics-token-0123456789abcdeX"}).status_code == 401
        assert client.post("/v1/admin/keys", json={"tenant": "t"}, headers=reader).status_code == 401
        assert client.get("/v1/admin/tiers", headers=reader).status_code == 401


def test_the_metrics_token_is_a_setting_checked_at_start(tmp_path):
    from pydantic import ValidationError

    from statekeeper.settings import Settings

    assert Settings(data_dir=tmp_path, metrics_token="m" * 16).to_config().metrics_token == "m" * 16
    for bad in ({"metrics_token": "short"}, {"metrics_token": "a" * 20, "admin_token": "a" * 20}):
        with pytest.raises(ValidationError):
            Settings(data_dir=tmp_path, **bad)
