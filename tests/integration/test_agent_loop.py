"""An agent loop on the real model through the official `openai` client (issue 30): call → tool result →
answer, two questions, with the tool-capable template fixture. SmolLM2 writes Hermes calls after a few
worked examples in its history; each call comes back as `tool_calls`, the client resends it with the tool's
result, and every round after the first restores the conversation from a tier (it is offloaded between
rounds) with ≥ 95% of the previous prompt cached, while the replies equal those of a server that prefills
every request afresh."""

import json

import pytest

from benchmarks.harness.live_server import live_server
from benchmarks.harness.openai_server import Server
from benchmarks.harness.templates import template_text

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CELSIUS = {"Rome": 18, "Oslo": 3, "Lima": 22, "Cairo": 30, "Paris": 25, "Tokyo": 12}


def worked_examples() -> list[dict]:
    """The history an agent framework would give a small model: a system prompt and four solved questions."""
    messages = [{"role": "system", "content": "You answer weather questions by calling get_weather first."}]
    for i, city in enumerate(("Rome", "Oslo", "Lima", "Cairo")):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                     {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"celsius": CELSIUS[city]})},
                     {"role": "assistant", "content": f"It is {CELSIUS[city]} degrees in {city}."}]
    return messages


@pytest.fixture
def servers(make_service, smollm2_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(smollm2_worker.tokenizer, "chat_template", template_text("tools-hermes"))
    stateful = make_service(worker=smollm2_worker, data_dir=tmp_path / "stateful")
    fresh = make_service(worker=smollm2_worker, tiers=("dram",), tier_budget_bytes=1, data_dir=tmp_path / "fresh")
    with live_server(stateful) as url, live_server(fresh) as reference_url:
        yield Server(url), Server(reference_url)


def ask(server: Server, messages: list[dict], **options):
    return server.client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, temperature=0,
                                                 max_tokens=40, **options)


def same_reply(a, b) -> bool:
    """Equal text and calls (names and arguments; each server gives its calls ids of its own)."""
    calls = [[(c.function.name, c.function.arguments) for c in m.tool_calls or ()] for m in (a, b)]
    return a.content == b.content and calls[0] == calls[1]


def test_an_agent_loop_restores_every_round_and_answers_as_a_fresh_prefill(servers):
    server, fresh = servers
    messages, previous, conversation = worked_examples(), None, None
    for city in ("Paris", "Tokyo"):
        messages.append({"role": "user", "content": f"What is the weather in {city}?"})
        for round_ in ("call", "answer"):
            completion = ask(server, messages)
            reply = completion.choices[0].message
            assert same_reply(reply, ask(fresh, messages).choices[0].message)
            if round_ == "call":
                assert completion.choices[0].finish_reason == "tool_calls"
                assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.tool_calls] == \
                    [("get_weather", {"city": city})]
            else:
                assert reply.tool_calls is None and str(CELSIUS[city]) in reply.content
            if previous is not None:  # the state came back from a tier, all but the new messages
                assert completion.statekeeper["conversation_id"] == conversation
                assert completion.statekeeper["restore"]["source"] not in ("active", "recompute")
                assert completion.usage.prompt_tokens_details.cached_tokens >= 0.95 * previous.usage.prompt_tokens
            conversation, previous = completion.statekeeper["conversation_id"], completion
            messages.append(reply.model_dump(exclude_none=True))  # as an agent resends it
            if round_ == "call":
                messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id,
                                 "content": json.dumps({"celsius": CELSIUS[city]})})
            server.offload(conversation)


def test_a_streamed_call_arrives_as_a_tool_calls_delta(servers):
    server, fresh = servers
    messages = worked_examples() + [{"role": "user", "content": "What is the weather in Paris?"}]
    expected = ask(fresh, messages).choices[0].message
    chunks = list(ask(server, messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [call for d in deltas for call in d.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(0, "get_weather", expected.tool_calls[0].function.arguments)]
    assert "".join(d.content or "" for d in deltas) == ""  # the call's text never streams as content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
