"""The Responses API and chat completions over HTTP (a tiny model behind the test client): what a request
with unusual but valid or invalid values gets."""

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app


@pytest.fixture
def client(make_service):
    service = make_service(max_tokens_limit=2)  # replies cut short: seldom ended by the model itself
    with TestClient(create_app(lambda: service)) as client:
        client.model = service.model_id
        yield client


def test_a_reply_cut_at_the_services_limit_is_incomplete(client):
    """Without max_output_tokens, a reply cut at MAX_TOKENS_LIMIT said "completed" while chat completions said
    finish_reason "length" for the same turn: agents took a cut-off reply for a finished one. (Which of the
    two it is depends on the random tiny model's reply: the same greedy turn through both APIs agrees.)"""
    prompt = "Tell me a long story."
    chat = client.post("/v1/chat/completions", json={"model": client.model,
                                                     "messages": [{"role": "user", "content": prompt}]}).json()
    response = client.post("/v1/responses", json={"model": client.model, "input": prompt}).json()
    cut = chat["choices"][0]["finish_reason"] == "length"
    assert response["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]
    assert response["status"] == ("incomplete" if cut else "completed")
    assert response["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)


@pytest.mark.parametrize("path, raw", [
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/responses", '{"model": "\\ud800", "input": "hi"}'),
    ("/v1/responses", '{"model": "MODEL", "input": "hi", "previous_response_id": ""}'),
    ("/v1/responses", '{"model": "MODEL", "input": "hi", "previous_response_id": "a\\u0000b"}'),
])
def test_a_model_name_or_response_id_no_request_could_mean_is_a_4xx(client, path, raw):
    """A lone surrogate in `model` was echoed into the 404's JSON (a 500 encoding it); an empty
    previous_response_id was an LMDB key error (500), one with a NUL PostgreSQL's."""
    raw = raw.replace("MODEL", client.model)
    answer = client.post(path, content=raw.encode(), headers={"content-type": "application/json"})
    assert 400 <= answer.status_code < 500 and "error" in answer.json()


@pytest.mark.parametrize("response_id", ["a%00b", "x" * 65])
def test_a_response_id_no_response_could_have_is_refused_before_any_lookup(client, response_id):
    for method in ("get", "delete"):
        assert 400 <= getattr(client, method)(f"/v1/responses/{response_id}").status_code < 500


def test_explicit_nulls_mean_the_defaults(client):
    """OpenAI's schema lets these be null (the default); clients that send them explicitly got a 400."""
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/v1/chat/completions", json={
        "model": client.model, "messages": messages, "temperature": None, "top_p": None, "n": None, "stream": None,
        "parallel_tool_calls": None, "logit_bias": {}})
    assert chat.status_code == 200, chat.text
    response = client.post("/v1/responses", json={
        "model": client.model, "input": "hi", "temperature": None, "top_p": None, "store": None, "stream": None,
        "parallel_tool_calls": None})
    assert response.status_code == 200, response.text
    assert json.loads(response.text)["store"] is True
