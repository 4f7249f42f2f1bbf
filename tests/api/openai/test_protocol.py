"""The OpenAI request bodies: bounds on what a client controls, refused with OpenAI's 400 error shape."""

import pytest
from pydantic import ValidationError

from api.openai.protocol import MAX_STOP_CHARS, MAX_STOP_SEQUENCES, ChatCompletionCreate

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["a", "y" * (MAX_STOP_CHARS + 1)],
                                  ["s"] * (MAX_STOP_SEQUENCES + 1)])
def test_stop_strings_over_the_bounds_are_refused(stop):
    with pytest.raises(ValidationError):
        ChatCompletionCreate(model="m", messages=MESSAGES, stop=stop)


def test_stop_strings_within_the_bounds_are_taken():
    stops = ["z" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES
    assert ChatCompletionCreate(model="m", messages=MESSAGES, stop=stops).stop_sequences == tuple(stops)


def test_an_over_long_stop_string_gets_a_400_over_http(make_service):
    from fastapi.testclient import TestClient

    from api.app import create_app

    with TestClient(create_app(lambda: make_service(), close_service=False)) as client:
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES,
                                                              "stop": "x" * (MAX_STOP_CHARS + 1)})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "stop" in response.json()["error"]["message"]


@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}])
def test_response_metadata_over_openais_bounds_is_refused(metadata):
    from api.openai.protocol import ResponseCreate

    with pytest.raises(ValidationError):
        ResponseCreate(model="m", input="hi", metadata=metadata)
    assert ResponseCreate(model="m", input="hi", metadata={f"k{i}": "v" * 512 for i in range(16)}).metadata


@pytest.mark.parametrize("options", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"d": "\ud800"}}}]},  # no UTF-8 form:
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"\ud800": {}}}}]},  # the tokenizer's
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maximum": float("nan")}}}]},  # 500
    {"chat_template_kwargs": {"temperature_hint": float("inf")}},  # no JSON form: stored with the history
])
def test_what_a_template_would_render_or_the_history_keep_is_plain_json(options):
    with pytest.raises(ValidationError, match="surrogate|NaN|finite"):
        ChatCompletionCreate(model="m", messages=MESSAGES, **options)
