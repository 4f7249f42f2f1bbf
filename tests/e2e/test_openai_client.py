"""The OpenAI-compatible API driven by the official `openai` client against the service under uvicorn
(issue 15). A client that resends its whole conversation on every turn gets its stored state back
without knowing statekeeper exists: `cached_tokens` counts the restored history, and the replies are
token for token those of a server that keeps no state (every turn recomputed from its history)."""

import threading

import httpx
import openai
import pytest

from benchmarks.harness.openai_server import MAX_TOKENS, TURNS


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


@pytest.mark.parametrize("stored", [True, False], ids=["source-stored", "source-active"])
def test_a_branched_conversation_restores_the_common_prefix_and_answers_as_a_fresh_prefill(servers, stored):
    """Edit turn 3 of 5: the new conversation starts from the KV the first holds of their common prefix
    (read from its tier, or copied from memory), answers as a prefill of everything would, and leaves the
    first as it was."""
    server, reference = servers
    completions = server.converse(TURNS[:5]) if stored else _converse_in_memory(server, TURNS[:5])
    original = completions[0].statekeeper["conversation_id"]
    messages = []
    for content, completion in zip(TURNS[:2], completions):
        messages += [{"role": "user", "content": content},
                     {"role": "assistant", "content": completion.choices[0].message.content}]
    edited = messages + [{"role": "user", "content": "What is the capital of Spain?"}]
    expected = reference.ask(edited)  # a server that has never seen this conversation: a fresh prefill
    branch = server.ask(edited)
    assert branch.choices[0].message.content == expected.choices[0].message.content
    assert branch.statekeeper["conversation_id"] != original
    assert branch.statekeeper["restore"]["source"] == ("dram" if stored else "active")
    assert branch.usage.prompt_tokens_details.cached_tokens >= completions[0].usage.prompt_tokens
    assert expected.usage.prompt_tokens_details.cached_tokens == 0
    held = httpx.get(f"{server.url}/v1/sessions/{original}/messages").json()["data"]
    assert len(held) == 10 and held[4]["content"] == TURNS[2]  # the first conversation is untouched


def _converse_in_memory(server, turns) -> list:
    messages, completions = [], []
    for content in turns:
        messages.append({"role": "user", "content": content})
        completions.append(server.ask(messages))
        messages.append({"role": "assistant", "content": completions[-1].choices[0].message.content})
    return completions


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
    # One continued the stored conversation; the other, which found it in a turn, started a conversation of
    # its own instead of waiting or extending it twice (from a prefill of the re-tokenized history, or a
    # branch off the common token prefix if the first turn was over by then).
    assert resumed.statekeeper["conversation_id"] == first.statekeeper["conversation_id"]
    assert resumed.choices[0].message.content == continued
    assert fresh.statekeeper["conversation_id"] != resumed.statekeeper["conversation_id"]
    assert fresh.usage.prompt_tokens_details.cached_tokens < resumed.usage.prompt_tokens_details.cached_tokens
    assert fresh.usage.completion_tokens > 0


@pytest.mark.parametrize("hint", ["", "x" * 600, "no such conversation!"])
def test_a_hint_that_names_no_conversation_is_ignored(servers, hint):
    server, _ = servers
    completion = server.ask([{"role": "user", "content": TURNS[0]}], extra_body={"prompt_cache_key": hint})
    assert completion.usage.completion_tokens > 0
    response = server.client.responses.create(model=server.model, input=TURNS[0], max_output_tokens=2,
                                              temperature=0, prompt_cache_key=hint)
    assert response.output_text


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


def test_prompt_cache_retention_24h_keeps_the_conversation_a_day_at_high_priority(servers):
    """OpenAI's extended prompt caching through the official client: the conversation the request continued
    keeps its stored state up to 24 hours at high priority; "in_memory" gives it back its tenant's."""
    server, _ = servers
    messages = [{"role": "user", "content": TURNS[0]}]
    completion = server.ask(messages, prompt_cache_retention="24h")
    conversation = completion.statekeeper["conversation_id"]
    view = httpx.get(f"{server.url}/v1/sessions/{conversation}").json()
    assert view["retention"] == {"pinned": False, "priority": "high", "ttl_seconds": 86_400}
    messages += [{"role": "assistant", "content": completion.choices[0].message.content},
                 {"role": "user", "content": TURNS[1]}]
    again = server.ask(messages, prompt_cache_retention="in_memory")
    assert again.statekeeper["conversation_id"] == conversation
    view = httpx.get(f"{server.url}/v1/sessions/{conversation}").json()
    assert view["retention"] == {"pinned": False, "priority": "normal", "ttl_seconds": None}
    with pytest.raises(openai.BadRequestError):  # not one of OpenAI's two values
        server.client.chat.completions.create(model=server.model, messages=messages, max_tokens=MAX_TOKENS,
                                              extra_body={"prompt_cache_retention": "forever"})
