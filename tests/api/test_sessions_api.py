import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from tests.utils.compression import wait_until_compressed


@pytest.fixture
def client(make_service):
    service = make_service(max_content_chars=200)
    with TestClient(create_app(lambda: service)) as test_client:
        test_client.service = service
        yield test_client


def _create(client, **body) -> str:
    response = client.post("/v1/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_chat_offload_restore_roundtrip(client):
    session = _create(client, system="be brief", metadata={"user": "u1"})
    assert len(session) >= 22  # >= 128 random bits, URL-safe base64
    first = client.post(f"/v1/sessions/{session}/messages", json={"content": "Hello, how are you today?", "max_tokens": 8})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["role"] == "assistant" and body["usage"]["completion_tokens"] == 8
    assert body["restore"]["source"] == "active" and body["timings"]["ttft_ms"] > 0
    state = client.get(f"/v1/sessions/{session}").json()
    assert state["state"] == "active" and state["turns"] == 1 and state["tier"] is None
    offloaded = client.post(f"/v1/sessions/{session}/offload").json()
    assert offloaded["state"] == "inactive" and offloaded["tier"] == "dram" and offloaded["stored_bytes"] > 0
    second = client.post(f"/v1/sessions/{session}/messages", json={"content": "Tell me about Rome.", "max_tokens": 8})
    assert second.json()["restore"]["source"] == "dram"
    assert second.json()["usage"]["cached_tokens"] == body["usage"]["prompt_tokens"] + 7
    messages = client.get(f"/v1/sessions/{session}/messages").json()["data"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[3]["content"] == second.json()["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_restored_by_a_gpu_workers_device_restorer_answers_with_its_report(client, tiny_worker, stream):
    """The GPU worker's restore path, by its CPU reference: its report is the answer's, not a failed stream
    (on an H100 every such turn ended in a 500 or a broken stream: its report is not a layer-by-layer one)."""
    from statekeeper.device_restore import DeviceRestorer

    client.service.loader.device_restorer = DeviceRestorer(tiny_worker)
    session = _create(client)
    first = client.post(f"/v1/sessions/{session}/messages", json={"content": "Hello there", "max_tokens": 4})
    client.post(f"/v1/sessions/{session}/offload")
    body = {"content": "Tell me about Rome.", "max_tokens": 4, "stream": stream}
    if stream:
        with client.stream("POST", f"/v1/sessions/{session}/messages", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and "error" not in events[-1]
        restore = events[-1]["restore"]
    else:
        response = client.post(f"/v1/sessions/{session}/messages", json=body)
        assert response.status_code == 200, response.text
        restore = response.json()["restore"]
    history_tokens = first.json()["usage"]["prompt_tokens"] + 3  # the reply's last token is not in the KV yet
    assert restore["source"] == "dram" and restore["layerwise"] is None
    assert restore["device"]["tokens"] == history_tokens and restore["device"]["copied_bytes"] > 0
    assert restore["device"]["compressed"] is False and restore["device"]["fallback"] is None


def test_streaming_sends_deltas_then_the_result(client):
    session = _create(client)
    with client.stream("POST", f"/v1/sessions/{session}/messages",
                       json={"content": "Hello", "max_tokens": 6, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    *deltas, final = events
    assert final["done"] is True and final["usage"]["completion_tokens"] == 6
    assert "".join(d["delta"] for d in deltas) == final["content"]
    assert client.get(f"/v1/sessions/{session}/messages").json()["data"][1]["content"] == final["content"]


def test_delete_removes_history_and_kv(client):
    session = _create(client)
    client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
    client.post(f"/v1/sessions/{session}/offload")
    assert client.delete(f"/v1/sessions/{session}").status_code == 204
    assert client.get(f"/v1/sessions/{session}").status_code == 404
    assert client.service.tiers.locate(session) is None and client.service.history.load(session) is None


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("get", "/v1/sessions/nope", None, 404),
        ("get", "/v1/sessions/nope/messages", None, 404),
        ("delete", "/v1/sessions/nope", None, 404),
        ("post", "/v1/sessions/nope/offload", None, 404),
        ("post", "/v1/sessions/nope/messages", {"content": "hi"}, 404),
        ("post", "/v1/sessions", {"system": 5}, 422),
        ("post", "/v1/sessions", {"unknown": 1}, 422),
    ],
)
def test_error_statuses(client, method, path, body, status):
    response = getattr(client, method)(path, **({} if body is None else {"json": body}))
    assert response.status_code == status
    assert "detail" in response.json()


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"content": "x" * 201}, 413, "maximum"),
        ({"content": "hi", "max_tokens": 1020}, 400, "context"),
        ({"content": "hi", "max_tokens": 0}, 422, ""),
        ({"content": "hi", "temperature": -1}, 422, ""),
        ({}, 422, ""),
        ({"content": "hi", "stream": True, "max_tokens": 1020}, 400, "context"),
    ],
)
def test_bad_turns_get_clear_errors_and_lose_nothing(client, body, status, fragment):
    session = _create(client)
    client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
    response = client.post(f"/v1/sessions/{session}/messages", json=body)
    assert response.status_code == status
    assert fragment in json.dumps(response.json())
    assert len(client.get(f"/v1/sessions/{session}/messages").json()["data"]) == 2


def test_turn_in_progress_is_409(client):
    session = _create(client)
    client.get(f"/v1/sessions/{session}")
    client.service.in_memory(session).in_turn = True  # as while another request is generating
    response = client.post(f"/v1/sessions/{session}/messages", json={"content": "hi"})
    assert response.status_code == 409 and "in progress" in response.json()["detail"]
    assert client.post(f"/v1/sessions/{session}/offload").status_code == 409
    client.service.in_memory(session).in_turn = False


def test_healthz(client):
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json()["status"] == "ok"
    assert any(note.startswith("KV cache dtype ") for note in response.json()["notes"])  # what was chosen, why


def test_stream_reports_a_mid_turn_failure_and_keeps_history(client, monkeypatch):
    session = _create(client)
    step = client.service.worker.step

    def failing_decode(segments):
        if all(len(segment.token_ids) == 1 for segment in segments):
            raise RuntimeError("worker fault")
        return step(segments)

    monkeypatch.setattr(client.service.worker, "step", failing_decode)
    with client.stream("POST", f"/v1/sessions/{session}/messages",
                       json={"content": "Hello", "max_tokens": 6, "stream": True}) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1]["done"] is True and events[-1]["status"] == 500
    assert "worker fault" not in events[-1]["error"]  # the exception's text is for the log only
    assert client.get(f"/v1/sessions/{session}/messages").json()["data"] == []


def test_prefetch_endpoint(client):
    session = _create(client)
    client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
    client.post(f"/v1/sessions/{session}/offload")
    service = client.service
    service.tiers.put(session, bytes(service.tiers.tiers[0].get(session)), tier="lmdb")
    assert client.get(f"/v1/sessions/{session}").json()["tier"] == "lmdb"
    assert client.post(f"/v1/sessions/{session}/prefetch").json()["tier"] == "dram"
    assert client.post("/v1/sessions/nope/prefetch").status_code == 404


def test_score_endpoint(client):
    session = _create(client)
    client.post(f"/v1/sessions/{session}/messages", json={"content": "Hi", "max_tokens": 3})
    before = client.get(f"/v1/sessions/{session}/messages").json()
    body = {"messages": [{"role": "user", "content": "Tell me about Rome."},
                         {"role": "assistant", "content": "Rome was not built in a day."}]}
    response = client.post(f"/v1/sessions/{session}/score", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["totals"]["tokens"] == len(result["tokens"]) > 0
    assert result["totals"]["matches"] == sum(t["match"] for t in result["tokens"])
    assert result["tokens"][-1]["text"] == "<|im_end|>"
    assert client.get(f"/v1/sessions/{session}/messages").json() == before
    bad = client.post(f"/v1/sessions/{session}/score", json={"messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 422
    assert client.post(f"/v1/sessions/{session}/score", json={"messages": []}).status_code == 422
    assert client.post("/v1/sessions/nope/score", json=body).status_code == 404


def test_create_with_compression_options(client):
    response = client.post("/v1/sessions", json={"compression": {"policy": "minicache", "ratio": 0.5}})
    assert response.status_code == 201
    session = response.json()["id"]
    assert client.get(f"/v1/sessions/{session}").json()["compression"] == "minicache"
    assert client.post("/v1/sessions", json={"compression": {"policy": "zip"}}).status_code == 422
    assert client.post("/v1/sessions", json={"compression": {"ratio": 2}}).status_code == 422
    assert client.post("/v1/sessions", json={"compression": {"unknown": 1}}).status_code == 422


def test_budgets_and_quantization_answer_through_rest_and_show_in_the_session(make_service):
    service = make_service(max_content_chars=200, compress_after_seconds=0, compress_quiet_seconds=0,
                           sweep_interval_seconds=0.1)
    with TestClient(create_app(lambda: service)) as client:
        _budgets_and_quantization(client)


def _budgets_and_quantization(client):
    compression = {"policy": "heads", "keep": 0.5, "budgets": "adaptive", "codec": "int4", "group_size": 32}
    session = _create(client, compression=compression)
    plain = _create(client)
    content = "Tell me about the history of Rome and of its emperors, from the founding to the fall. " * 2
    for sid in (session, plain):
        assert client.post(f"/v1/sessions/{sid}/messages", json={"content": content, "max_tokens": 8}).status_code == 200
    exact, full = (client.post(f"/v1/sessions/{sid}/offload").json() for sid in (session, plain))
    # Offload stores the exact state at once; the background compression re-encodes it soon after.
    assert (exact["is_compressed"], exact["codec"]) == (False, "none") and exact["stored_bytes"] == full["stored_bytes"]
    small = wait_until_compressed(client, session)
    assert (small["compression"], small["codec"], small["is_compressed"]) == ("heads", "int4-g32", True)
    assert full["codec"] == "none" and full["is_compressed"] is False
    assert small["stored_bytes"] < 0.3 * full["stored_bytes"]
    second = client.post(f"/v1/sessions/{session}/messages", json={"content": "And then?", "max_tokens": 8})
    assert second.status_code == 200 and second.json()["restore"]["source"] == "dram"
    assert second.json()["usage"]["completion_tokens"] == 8
    for bad in ({"codec": "int3"}, {"codec": "int4-rot-kc"}, {"keep": 0}, {"scorer": "magic"}, {"budgets": "static"},
                {"codec": "int4-g24"}, {"codec": "int4-v2-vg48"}, {"codec": "int8", "group_size": 24}):
        # Group sizes that match the pattern but that the codec cannot take are refused here, not at offload.
        response = client.post("/v1/sessions", json={"compression": bad})
        assert response.status_code == 422, bad


def test_careless_and_hostile_input_is_a_4xx_and_changes_nothing(client):
    """Issue 14 item 8: each of these was a 500 or was stored."""
    session = _create(client)
    turn = f"/v1/sessions/{session}/messages"
    assert client.post(turn, json={"content": "Hi", "max_tokens": 3}).status_code == 200
    before = client.get(turn).json()
    bad_turns = [
        json.dumps({"content": "Hi", "max_tokens": 3, "seed": 2**80}),
        json.dumps({"content": "Hi", "max_tokens": 3, "seed": -1}),
        '{"content": "Hi", "max_tokens": 3, "temperature": NaN}',
        '{"content": "Hi", "max_tokens": 3, "top_p": NaN}',
        '{"content": "Hi \\ud800 there", "max_tokens": 3}',  # a lone surrogate: no UTF-8 for it
    ]
    for body in bad_turns:
        response = client.post(turn, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 422, (body, response.status_code, response.text)
    assert client.get(turn).json() == before
    for body in ({"system": "x" * 5_000_000}, {"system": "Be kind \ud800"},
                 {"metadata": {"blob": "x" * 5_000_000}}, {"metadata": _nested(40)},
                 {"metadata": {"a": [float("nan")]}}, {"metadata": {"a": float("inf")}},  # no JSON form: PostgreSQL
                 {"metadata": {"a": "\ud800"}}, {"metadata": {"\ud800": 1}}):  # refuses it

        response = client.post("/v1/sessions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert response.status_code in (413, 422), (str(body)[:60], response.status_code)
    # Deeper than Python's recursion limit, which the JSON parser takes (benchmarks/abuse.py: a 500 at 900
    # levels of lists); past what the parser takes, FastAPI's own 400.
    deep = client.post("/v1/sessions", content='{"metadata": {"a": ' + "[" * 900 + "]" * 900 + "}}",
                       headers={"content-type": "application/json"})
    assert deep.status_code == 422 and "deeper" in deep.text, deep.text[:200]
    deeper = client.post("/v1/sessions", content='{"metadata": ' + '{"a": ' * 5000 + "{}" + "}" * 5001,
                         headers={"content-type": "application/json"})
    assert deeper.status_code in (400, 422), deeper.text[:200]


def _nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def test_a_malformed_session_id_is_refused_before_any_lookup(client):
    for bad in ("x" * 65, "bad.id", "a%20b", "%00"):
        assert client.get(f"/v1/sessions/{bad}").status_code == 422, bad
        assert client.post(f"/v1/sessions/{bad}/messages", json={"content": "Hi"}).status_code == 422, bad
    assert client.get(f"/v1/sessions/{'x' * 32}").status_code == 404  # well formed, unknown


INTERNAL = "/srv/statekeeper/internal-detail-7f3a"


def test_healthz_does_not_echo_exception_text(client, monkeypatch):
    def broken():
        raise OSError(5, f"I/O error at {INTERNAL}")

    monkeypatch.setattr(client.service.history, "check_writable", broken)
    response = client.get("/healthz")
    assert response.status_code == 503 and INTERNAL not in response.text


def test_a_stream_that_fails_after_its_200_does_not_echo_exception_text(client, monkeypatch):
    session = _create(client)

    def broken(conversation, expected_turns, fence=None):
        raise RuntimeError(f"lmdb failure at {INTERNAL}")

    monkeypatch.setattr(client.service.history, "commit_turn", broken)
    with client.stream("POST", f"/v1/sessions/{session}/messages",
                       json={"content": "Hello", "max_tokens": 4, "stream": True}) as response:
        body = "".join(response.iter_lines())
    assert response.status_code == 200 and INTERNAL not in body
    final = json.loads(body.rpartition("data: ")[2])
    assert final["done"] is True and final["error"]


def test_a_stream_refused_by_the_service_says_why(client, monkeypatch):
    session = _create(client)

    def full(conversation, expected_turns, fence=None):
        raise OSError(28, f"No space left on device: {INTERNAL}")

    monkeypatch.setattr(client.service.history, "commit_turn", full)
    with client.stream("POST", f"/v1/sessions/{session}/messages",
                       json={"content": "Hello", "max_tokens": 4, "stream": True}) as response:
        body = "".join(response.iter_lines())
    final = json.loads(body.rpartition("data: ")[2])
    assert final["status"] == 507 and "out of space" in final["error"] and INTERNAL not in body


def test_docs_and_schema_are_off_in_production(make_service, tmp_path, monkeypatch):
    from statekeeper.settings import load_settings

    monkeypatch.setenv("STATEKEEPER_ENVIRONMENT", "production")
    monkeypatch.setenv("STATEKEEPER_ADMIN_TOKEN", "x" * 16)
    config = load_settings(data_dir=str(tmp_path)).to_config()
    service = make_service()
    with TestClient(create_app(lambda: service, show_docs=config.show_docs)) as production:
        assert [production.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [404] * 3
    assert load_settings(environment="development", data_dir=str(tmp_path)).to_config().show_docs


def test_retention_is_set_at_creation_and_replaced_by_put(client):
    session = _create(client, retention={"pinned": True, "ttl_seconds": 3600})
    assert client.get(f"/v1/sessions/{session}").json()["retention"] == {"pinned": True, "priority": "normal",
                                                                          "ttl_seconds": 3600}
    replaced = client.put(f"/v1/sessions/{session}/retention", json={"priority": "high"})
    assert replaced.status_code == 200 and replaced.json()["retention"] == {"pinned": False, "priority": "high",
                                                                            "ttl_seconds": None}
    for bad in ({"priority": "urgent"}, {"ttl_seconds": 5}, {"pinned": "yes please"}, {"forever": True}):
        assert client.put(f"/v1/sessions/{session}/retention", json=bad).status_code == 422, bad
        assert client.post("/v1/sessions", json={"retention": bad}).status_code == 422, bad
    assert client.get(f"/v1/sessions/{session}").json()["retention"]["priority"] == "high"  # refused: unchanged
    assert client.put(f"/v1/sessions/{'x' * 32}/retention", json={}).status_code == 404
