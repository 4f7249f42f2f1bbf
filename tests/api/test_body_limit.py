"""Request bodies over the limit are refused with 413 before the service reads them (issue 14 item 8),
whether the client declares the length or streams the body in chunks; nothing is created."""

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app

LIMIT = 4096


@pytest.fixture
def client(make_service):
    service = make_service()
    with TestClient(create_app(lambda: service, max_body_bytes=LIMIT)) as test_client:
        yield test_client


def _body(size: int) -> bytes:
    return json.dumps({"metadata": {"note": "x" * size}}).encode()


def test_a_declared_body_over_the_limit_gets_413(client):
    response = client.post("/v1/sessions", content=_body(LIMIT), headers={"content-type": "application/json"})
    assert response.status_code == 413 and str(LIMIT) in response.json()["detail"]


def test_a_streamed_body_over_the_limit_gets_413(client):
    body = _body(LIMIT)
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))  # no Content-Length: chunked
    response = client.post("/v1/sessions", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413 and str(LIMIT) in response.json()["detail"]


def test_a_body_under_the_limit_is_served(client):
    response = client.post("/v1/sessions", content=_body(LIMIT // 2), headers={"content-type": "application/json"})
    assert response.status_code == 201, response.text
    session = response.json()["id"]
    body = _body(LIMIT // 2)
    chunks = (body[i : i + 1000] for i in range(0, len(body), 1000))
    assert client.post("/v1/sessions", content=chunks, headers={"content-type": "application/json"}).status_code == 201
    assert client.get(f"/v1/sessions/{session}").status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
@pytest.mark.parametrize("streamed", [False, True], ids=["declared", "chunked"])
def test_an_openai_path_refuses_a_body_over_the_limit_in_openais_error_shape(client, path, streamed):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * LIMIT}]}).encode()
    content = (body[i : i + 1000] for i in range(0, len(body), 1000)) if streamed else body
    response = client.post(path, content=content, headers={"content-type": "application/json"})
    error = response.json()["error"]  # what OpenAI's SDKs read the message from
    assert response.status_code == 413 and str(LIMIT) in error["message"] and error["type"] == "invalid_request_error"
