"""The OpenAI-compatible API driven by the official `openai` client against the service under uvicorn
(issue 15). A client that resends its whole conversation on every turn gets its stored state back
without knowing statekeeper exists: `cached_tokens` counts the restored history, and the replies are
token for token those of a server that keeps no state (every turn recomputed from its history)."""

import threading

import httpx
import openai
import pytest

from tests.utils.live_server import live_server

TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
         "Name three rivers.", "Which is the longest?", "Thank you, that is all."]
MAX_TOKENS = 8


class Server:
    """A live server as an OpenAI client and a plain HTTP client see it."""

    def __init__(self, url: str):
        self.url = url
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        self.model = self.client.models.list().data[0].id

    def ask(self, messages, **options):
        return self.client.chat.completions.create(model=self.model, messages=messages, temperature=0,
                                                   max_tokens=MAX_TOKENS, **options)

    def offload(self, conversation_id: str) -> None:
        assert httpx.post(f"{self.url}/v1/sessions/{conversation_id}/offload").status_code == 200

    def converse(self, turns=TURNS, **options) -> list:
        """Resends the whole conversation each turn, as OpenAI clients do, the state leaving memory between
        turns; returns each turn's completion."""
        messages, completions = [], []
        for content in turns:
            messages.append({"role": "user", "content": content})
            completion = self.ask(messages, **options)
            messages.append({"role": "assistant", "content": completion.choices[0].message.content})
            self.offload(completion.statekeeper["conversation_id"])
            completions.append(completion)
        return completions


@pytest.fixture
def servers(make_service, tmp_path):
    """A statekeeper server (DRAM, then LMDB) and a reference that keeps no state: its one tier has no
    room, so a state that leaves memory is gone and each of its turns recomputes from the history."""
    stateful = make_service(data_dir=tmp_path / "stateful")
    stateless = make_service(tiers=("dram",), tier_budget_bytes=1, data_dir=tmp_path / "stateless")
    with live_server(stateful) as url, live_server(stateless) as reference_url:
        yield Server(url), Server(reference_url)


def test_a_resent_conversation_restores_its_state_and_answers_as_a_stateless_server(servers):
    server, reference = servers
    completions, expected = server.converse(), reference.converse()
    assert [c.choices[0].message.content for c in completions] == [c.choices[0].message.content for c in expected]
    for previous, completion in zip(completions, completions[1:]):
        cached = completion.usage.prompt_tokens_details.cached_tokens
        assert cached >= 0.9 * previous.usage.prompt_tokens  # the whole previous prompt and most of its reply
        assert completion.statekeeper["restore"]["source"] == "dram"
    conversations = {c.statekeeper["conversation_id"] for c in completions}
    assert len(conversations) == 1  # one conversation, found again each turn
    assert all(c.usage.prompt_tokens_details.cached_tokens == 0 for c in expected)  # the reference kept nothing
    stored = httpx.get(f"{server.url}/v1/sessions/{conversations.pop()}/messages").json()["data"]
    assert [m["content"] for m in stored if m["role"] == "user"] == TURNS


def test_streaming_with_usage_sends_the_reply_in_chunks(servers):
    server, reference = servers
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": TURNS[0]}]
    first = server.ask(messages)
    assert reference.ask(messages).choices[0].message.content == first.choices[0].message.content
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    expected = reference.ask(messages).choices[0].message.content
    chunks = list(server.ask(messages, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]  # MAX_TOKENS reached
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == MAX_TOKENS
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_a_conversation_continues_over_either_api(servers):
    server, _ = servers
    messages = [{"role": "user", "content": TURNS[0]}]
    first = server.ask(messages)
    conversation = first.statekeeper["conversation_id"]
    native = httpx.post(f"{server.url}/v1/sessions/{conversation}/messages",
                        json={"content": TURNS[1], "max_tokens": MAX_TOKENS}).json()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]},
                 {"role": "assistant", "content": native["content"]},
                 {"role": "user", "content": TURNS[2]}]
    third = server.ask(messages)
    assert third.statekeeper["conversation_id"] == conversation
    assert third.usage.prompt_tokens_details.cached_tokens >= native["usage"]["prompt_tokens"]


def test_a_sessions_conversation_is_continued_by_its_id_only(servers):
    """A /v1/sessions client drives its conversation by id: an OpenAI request that happens to resend the
    same history starts its own, unless it names that conversation (X-Statekeeper-Conversation)."""
    server, _ = servers
    native = httpx.post(f"{server.url}/v1/sessions", json={}).json()["id"]
    reply = httpx.post(f"{server.url}/v1/sessions/{native}/messages",
                       json={"content": TURNS[0], "max_tokens": MAX_TOKENS}).json()
    messages = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": reply["content"]},
                {"role": "user", "content": TURNS[1]}]
    other = server.ask(messages)
    assert other.statekeeper["conversation_id"] != native
    assert len(httpx.get(f"{server.url}/v1/sessions/{native}/messages").json()["data"]) == 2  # untouched
    named = server.ask(messages, extra_headers={"X-Statekeeper-Conversation": native})
    assert named.statekeeper["conversation_id"] == native
    assert named.usage.prompt_tokens_details.cached_tokens >= reply["usage"]["prompt_tokens"]
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_a_reply_cut_at_a_stop_string_is_resumed_like_any_other(servers):
    server, reference = servers
    options = {"stop": [" the", "."]}
    completions, expected = server.converse(TURNS[:3], **options), reference.converse(TURNS[:3], **options)
    replies = [c.choices[0].message.content for c in completions]
    assert replies == [c.choices[0].message.content for c in expected]
    assert all(" the" not in reply and "." not in reply for reply in replies)
    assert any(c.choices[0].finish_reason == "stop" for c in completions)
    for completion in completions[1:]:
        assert completion.usage.prompt_tokens_details.cached_tokens > 0


def test_two_clients_resending_the_same_history_at_once_both_get_answers(servers):
    server, reference = servers
    messages = [{"role": "user", "content": TURNS[0]}]
    first = server.ask(messages)
    assert reference.ask(messages).choices[0].message.content == first.choices[0].message.content
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    continued = reference.ask(messages).choices[0].message.content
    results, barrier = [None, None], threading.Barrier(2)

    def send(index):
        barrier.wait()
        results[index] = server.ask(messages)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    by_cache = sorted(results, key=lambda r: r.usage.prompt_tokens_details.cached_tokens)
    fresh, resumed = by_cache
    # One continued the stored conversation; the other, which found it in a turn, started afresh (a full
    # prefill of the re-tokenized history) instead of waiting or extending it twice.
    assert resumed.statekeeper["conversation_id"] == first.statekeeper["conversation_id"]
    assert resumed.choices[0].message.content == continued
    assert fresh.statekeeper["conversation_id"] != resumed.statekeeper["conversation_id"]
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0 and fresh.usage.completion_tokens > 0


@pytest.mark.parametrize("options, error, fragment", [
    ({"model": "gpt-4o"}, openai.NotFoundError, "does not exist"),
    ({"n": 2}, openai.BadRequestError, "n must be 1"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, openai.BadRequestError, "tools"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     openai.BadRequestError, "last message"),
    ({"temperature": 3}, openai.BadRequestError, "temperature"),
])
def test_requests_it_cannot_serve_get_openai_shaped_errors(servers, options, error, fragment):
    server, _ = servers
    request = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2} | options
    with pytest.raises(error) as raised:
        server.client.chat.completions.create(**request)
    assert fragment in str(raised.value)
    assert raised.value.body["type"] in ("invalid_request_error", "not_found_error")
