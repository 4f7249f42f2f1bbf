"""A reasoning template through the official `openai` client (issue 30): the think block comes back apart
from the answer (`reasoning_content`, streamed as its own deltas), the conversation keeps the answer as the
client resends it, and the next turn keeps the KV of everything before the dropped think block."""

import httpx
import pytest

from benchmarks.harness.live_server import live_server
from benchmarks.harness.openai_server import TURNS, Server
from benchmarks.harness.templates import template_text
from tests.statekeeper.test_chat import THINK_ON


@pytest.fixture
def servers(make_service, tiny_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", THINK_ON)
    stateful = make_service(data_dir=tmp_path / "stateful")
    stateless = make_service(tiers=("dram",), tier_budget_bytes=1, data_dir=tmp_path / "stateless")
    with live_server(stateful) as url, live_server(stateless) as reference_url:
        yield Server(url), Server(reference_url)


def test_the_think_block_comes_apart_and_the_next_turn_keeps_the_kv_before_it(servers, tiny_worker):
    server, _ = servers
    # The opened block's tokens (one more where the tokenizer merges across its boundary).
    opener = len(tiny_worker.tokenizer("<think>\n", add_special_tokens=False)["input_ids"]) + 1
    messages, completions = [], []
    for content in TURNS[:3]:
        messages.append({"role": "user", "content": content})
        completion = server.ask(messages)
        message = completion.choices[0].message
        assert message.reasoning_content is not None  # the generation prompt opened a think block
        reasoning_tokens = completion.usage.completion_tokens_details.reasoning_tokens
        if message.content:  # the block closed: the tokens after its closing tag are the answer's
            assert 0 < reasoning_tokens < completion.usage.completion_tokens
        else:
            assert reasoning_tokens == completion.usage.completion_tokens
        messages.append({"role": "assistant", "content": message.content})  # what clients resend
        completions.append(completion)
    assert len({c.statekeeper["conversation_id"] for c in completions}) == 1  # found again each turn
    for previous, completion in zip(completions, completions[1:]):
        # All of the previous prompt but the opened think block, which the template drops from the history.
        cached = completion.usage.prompt_tokens_details.cached_tokens
        assert previous.usage.prompt_tokens - opener <= cached < previous.usage.prompt_tokens
        assert completion.statekeeper["restore"]["source"] == "active"
    stored = httpx.get(f"{server.url}/v1/sessions/{completions[0].statekeeper['conversation_id']}/messages").json()
    assert [m["content"] for m in stored["data"] if m["role"] == "assistant"] == \
        [c.choices[0].message.content for c in completions]


def test_streamed_reasoning_arrives_as_reasoning_content_deltas(servers):
    server, reference = servers
    messages = [{"role": "user", "content": TURNS[0]}]
    expected = reference.ask(messages).choices[0].message
    chunks = list(server.ask(messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == expected.reasoning_content
    assert "".join(d.content or "" for d in deltas) == expected.content


def test_the_responses_api_returns_the_think_block_as_a_reasoning_item(servers):
    server, reference = servers
    expected = reference.ask([{"role": "user", "content": TURNS[0]}]).choices[0].message
    response = server.client.responses.create(model=server.model, input=TURNS[0], max_output_tokens=8,
                                              temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text == expected.reasoning_content
    assert response.output_text == expected.content
    details = response.usage.output_tokens_details
    assert (details.reasoning_tokens == response.usage.output_tokens) == (not expected.content)


def test_a_responses_output_resent_as_input_with_its_reasoning_item_is_taken(servers):
    """OpenAI's way to keep state by hand: `input += response.output`. The reasoning item is taken and left
    out of the history, as the template drops earlier turns' think blocks."""
    server, _ = servers
    first = server.client.responses.create(model=server.model, input=TURNS[0], max_output_tokens=8, temperature=0)
    assert first.output[0].type == "reasoning"
    items = [{"role": "user", "content": TURNS[0]}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"role": "user", "content": TURNS[1]}]
    second = server.client.responses.create(model=server.model, input=items, max_output_tokens=8, temperature=0)
    assert second.output[-1].type == "message"
    assert second.usage.input_tokens_details.cached_tokens > 0  # the conversation found again
    alone = httpx.post(f"{server.url}/v1/responses", json={"model": server.model, "input": [{"type": "reasoning"}]})
    assert alone.status_code == 400 and "last input item" in alone.json()["error"]["message"]


@pytest.fixture
def qwen3_like(make_service, tiny_worker, monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_worker.tokenizer, "chat_template", template_text("think"))
    with live_server(make_service(data_dir=tmp_path / "think")) as url:
        yield Server(url)


def test_chat_template_kwargs_choose_the_thinking_mode_per_request(qwen3_like, tiny_worker):
    """Qwen3's `enable_thinking` (vLLM's chat_template_kwargs): off, the prompt closes an empty think block and
    the reply is all answer; on (the template's default), it opens one and the reply starts as reasoning."""
    messages = [{"role": "user", "content": TURNS[0]}]
    on = qwen3_like.ask(messages).choices[0].message
    off = qwen3_like.ask(messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on.reasoning_content  # the opened block: everything up to a closing tag is reasoning
    assert off.choices[0].message.reasoning_content == "" and off.choices[0].message.content
    assert off.usage.completion_tokens_details.reasoning_tokens == 0
    # The next turn finds the conversation and keeps at least all of its prompt before the empty think block
    # the history drops (all of it, if the next turn's state was prepared before the request came: a request
    # that comes first takes over from the preparation).
    messages += [{"role": "assistant", "content": off.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    after = qwen3_like.ask(messages, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert after.statekeeper["conversation_id"] == off.statekeeper["conversation_id"]
    block = len(tiny_worker.tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]) + 1
    assert after.usage.prompt_tokens_details.cached_tokens >= off.usage.prompt_tokens - block


def test_chat_template_kwargs_may_not_set_what_the_service_renders_with(qwen3_like):
    response = httpx.post(f"{qwen3_like.url}/v1/chat/completions", json={
        "model": qwen3_like.model, "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400 and "add_generation_prompt" in response.json()["error"]["message"]
