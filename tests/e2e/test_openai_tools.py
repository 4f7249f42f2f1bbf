"""Tools through the official `openai` client (issue 30), on the tiny model with a tool-capable template
fixture: calls and results resent by an agent join the history as OpenAI shapes them and find the
conversation again, so its state is restored rather than recomputed; a template without tools gets OpenAI's
400. (Whether a model's own calls come back as `tool_calls` is tests/e2e/test_agent_loop.py, with the real
model, and tests/statekeeper/test_tool_calls.py.)"""

import json

import httpx
import openai
import pytest

from benchmarks.harness.live_server import live_server
from benchmarks.harness.openai_server import Server
from benchmarks.harness.templates import template_text

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city today.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "call_weather1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}


@pytest.fixture
def server(make_service, tiny_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", template_text("tools-hermes"))
    with live_server(make_service(data_dir=tmp_path / "tools")) as url:
        yield Server(url)


@pytest.fixture
def plain_server(make_service, tmp_path):
    with live_server(make_service(data_dir=tmp_path / "plain")) as url:
        yield Server(url)


def agent_messages() -> list[dict]:
    return [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": CALL["id"], "content": json.dumps({"celsius": 21, "sky": "clear"})}]


def test_a_template_without_tools_refuses_them_with_openais_400(plain_server):
    with pytest.raises(openai.BadRequestError) as refused:
        plain_server.ask([{"role": "user", "content": "hi"}], tools=TOOLS)
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == "tools" and refused.value.body["code"] == "tools_not_supported"


def test_forcing_a_call_is_refused_by_name(server):
    with pytest.raises(openai.BadRequestError) as refused:
        server.ask([{"role": "user", "content": "hi"}], tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert "tool_choice" in refused.value.body["message"]


@pytest.mark.parametrize("message", [
    {"role": "tool", "content": "21"},  # no tool_call_id
    {"role": "tool", "tool_call_id": "call_1"},  # no result
    {"role": "assistant", "content": None},  # neither text nor calls
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f"}}]},
])
def test_malformed_tool_messages_get_a_400(server, message):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}, message,
                                            {"role": "user", "content": "again"}]})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


def _replying(monkeypatch, worker, text: str) -> None:
    """The model's next reply is `text` (then its end-of-turn token), whatever it is asked."""
    tokens = iter(worker.tokenizer(text, add_special_tokens=False)["input_ids"] + [worker.tokenizer.eos_token_id])
    monkeypatch.setattr(worker, "sample", lambda *args: next(tokens))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("name", ["functions.get_weather", "get weather", "get_time"])
def test_a_call_the_api_cannot_return_comes_back_as_text(server, tiny_worker, monkeypatch, name, stream):
    """A name OpenAI's rule refuses, or no offered tool has: the reply is text, never a 500 or a cut stream."""
    text = '<tool_call>{"name": "%s", "arguments": {"city": "Paris"}}</tool_call>' % name
    _replying(monkeypatch, tiny_worker, text)
    reply = server.client.chat.completions.create(model=server.model, tools=TOOLS, max_tokens=200, stream=stream,
                                                  messages=[{"role": "user", "content": "The weather in Paris?"}])
    if not stream:
        choice = reply.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")
        return
    chunks = list(reply)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"


def test_options_the_template_cannot_render_get_a_400(make_service, tiny_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", template_text("dated"))
    with live_server(make_service(data_dir=tmp_path / "dated")) as url:
        response = httpx.post(f"{url}/v1/chat/completions", json={
            "model": Server(url).model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "chat_template_kwargs": {"date_string": 5}})  # the template adds it to text
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert "chat template" in response.json()["error"]["message"]


def test_an_agents_calls_and_results_join_the_history_and_the_next_step_restores_it(server):
    messages = agent_messages()
    first = server.ask(messages, tools=TOOLS)  # the turn after a tool result
    conversation_id = first.statekeeper["conversation_id"]
    reply = first.choices[0].message
    messages += [{"role": "assistant", "content": reply.content,
                  **({"tool_calls": [c.model_dump() for c in reply.tool_calls]} if reply.tool_calls else {})},
                 {"role": "user", "content": "And in Rome?"}]
    second = server.ask(messages, tools=TOOLS)
    assert second.statekeeper["conversation_id"] == conversation_id  # found again by the resent messages
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.95 * first.usage.prompt_tokens
    stored = httpx.get(f"{server.url}/v1/sessions/{conversation_id}/messages").json()["data"]
    assert stored[1]["tool_calls"] == [CALL] and stored[1]["content"] == ""
    assert stored[2]["role"] == "tool" and stored[2]["tool_call_id"] == CALL["id"]


def test_other_tools_render_another_prompt_and_keep_the_shared_prefix(server):
    messages = agent_messages()
    first = server.ask(messages, tools=TOOLS)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Thanks."}]
    more = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    second = server.ask(messages, tools=more)
    assert second.statekeeper["conversation_id"] == first.statekeeper["conversation_id"]
    # The tool list is in the system turn: what both renderings share is the turn's opening tokens only.
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens


def test_the_responses_api_takes_function_calls_and_their_outputs(server):
    client = server.client
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    first = client.responses.create(model=server.model, tools=tools, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": CALL["id"], "name": "get_weather", "arguments": CALL["function"]["arguments"]},
        {"type": "function_call_output", "call_id": CALL["id"], "output": "21 degrees"}])
    assert first.tool_choice == "auto" and first.tools[0].name == "get_weather"
    second = client.responses.create(model=server.model, tools=tools, max_output_tokens=8, temperature=0,
                                     previous_response_id=first.id, input="And in Rome?")
    assert second.statekeeper["conversation_id"] == first.statekeeper["conversation_id"]
    assert second.usage.input_tokens_details.cached_tokens >= 0.95 * first.usage.input_tokens
    stored = httpx.get(f"{server.url}/v1/sessions/{first.statekeeper['conversation_id']}/messages").json()["data"]
    assert stored[1]["tool_calls"][0]["id"] == CALL["id"] and stored[2]["tool_call_id"] == CALL["id"]
