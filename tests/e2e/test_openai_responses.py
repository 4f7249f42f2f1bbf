"""OpenAI's Responses API (issue 15) with the official `openai` client against the service under uvicorn:
a conversation continued by `previous_response_id` restores its stored state and answers as a server
that keeps no state; responses are read and deleted by id; continuing from an older response branches
without touching the conversation it came from; `store: false` keeps nothing to continue from."""

import httpx
import openai
import pytest

from benchmarks.harness.openai_server import MAX_TOKENS, TURNS, Server


def _respond(server: Server, content: str, previous: str | None = None, **options):
    return server.client.responses.create(model=server.model, input=content, previous_response_id=previous,
                                          temperature=0, max_output_tokens=MAX_TOKENS, **options)


def _chain(server: Server, turns=TURNS[:4]) -> list:
    """One conversation by previous_response_id, its state leaving memory between turns."""
    responses, previous = [], None
    for content in turns:
        response = _respond(server, content, previous)
        server.offload(response.statekeeper["conversation_id"])
        responses.append(response)
        previous = response.id
    return responses


def test_a_conversation_continued_by_previous_response_id_restores_its_state(servers):
    server, reference = servers
    ours, expected = _chain(server), _chain(reference)
    assert [r.output_text for r in ours] == [r.output_text for r in expected]
    assert len({r.statekeeper["conversation_id"] for r in ours}) == 1  # one conversation, extended
    for before, after in zip(ours, ours[1:]):
        assert after.usage.input_tokens_details.cached_tokens >= 0.9 * before.usage.input_tokens
        assert after.statekeeper["restore"]["source"] != "recompute" and after.previous_response_id == before.id
    assert ours[0].usage.input_tokens_details.cached_tokens == 0
    messages = httpx.get(f"{server.url}/v1/sessions/{ours[0].statekeeper['conversation_id']}/messages").json()["data"]
    assert [m["content"] for m in messages[0::2]] == TURNS[:4]  # the same history over /v1/sessions
    assert [m["content"] for m in messages[1::2]] == [r.output_text for r in ours]


def test_a_stored_response_is_read_and_deleted_by_id(servers):
    server, _ = servers
    response = _respond(server, TURNS[0], metadata={"topic": "greeting"})
    read = server.client.responses.retrieve(response.id)
    assert (read.id, read.output_text, read.metadata, read.status) == (response.id, response.output_text,
                                                                      {"topic": "greeting"}, response.status)
    server.client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as refused:
        _respond(server, TURNS[1], response.id)
    assert refused.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        server.client.responses.delete(response.id)


def test_continuing_from_an_older_response_branches_and_leaves_the_conversation_as_it_was(servers):
    server, reference = servers
    first, second = _chain(server, TURNS[:2])
    branch = _respond(server, TURNS[2], first.id)
    # A branch is a new conversation of the history as text (the reply re-tokenized): a server that has
    # never seen it, prefilling all of it, answers the same.
    expected = reference.ask([{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": TURNS[2]}])
    assert branch.output_text == expected.choices[0].message.content
    assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the common prefix
    original = first.statekeeper["conversation_id"]
    assert branch.statekeeper["conversation_id"] != original
    messages = httpx.get(f"{server.url}/v1/sessions/{original}/messages").json()["data"]
    assert [m["content"] for m in messages] == [TURNS[0], first.output_text, TURNS[1], second.output_text]
    after_second = _respond(server, TURNS[3], second.id)  # the original still continues from its end
    assert after_second.statekeeper["conversation_id"] == original


def test_a_conversation_continued_over_sessions_is_the_history_a_response_continues(servers):
    server, _ = servers
    first = _respond(server, TURNS[0])
    conversation = first.statekeeper["conversation_id"]
    turn = httpx.post(f"{server.url}/v1/sessions/{conversation}/messages", json={"content": TURNS[1], "max_tokens": 4})
    assert turn.status_code == 200
    messages = httpx.get(f"{server.url}/v1/sessions/{conversation}/messages").json()["data"]
    assert [m["content"] for m in messages] == [TURNS[0], first.output_text, TURNS[1], turn.json()["content"]]
    # The response answered the conversation's first turn: continuing from it leaves the later turn out.
    branch = _respond(server, TURNS[2], first.id)
    assert branch.statekeeper["conversation_id"] != conversation


def test_a_response_not_stored_cannot_be_read_or_continued(servers):
    server, _ = servers
    response = _respond(server, TURNS[0], store=False)
    assert response.output_text and response.store is False
    with pytest.raises(openai.NotFoundError):
        server.client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        _respond(server, TURNS[1], response.id)


@pytest.mark.parametrize("options, fragment", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"stream": True}, "stream"),
    ({"input": [{"role": "assistant", "content": "Hi"}]}, "last input item"),
])
def test_requests_it_cannot_serve_get_openai_shaped_errors(servers, options, fragment):
    server, _ = servers
    body = {"model": server.model, "input": "Hi"} | options
    answer = httpx.post(f"{server.url}/v1/responses", json=body)
    assert answer.status_code == 400 and fragment in answer.json()["error"]["message"]


def test_stored_responses_go_with_their_deleted_conversation(servers):
    """The LMDB history (one process); tests/e2e/test_replica_deletes.py has PostgreSQL's, across replicas."""
    server, _ = servers
    first = _respond(server, TURNS[0])
    second = _respond(server, TURNS[1], first.id)
    conversation = first.statekeeper["conversation_id"]
    assert httpx.delete(f"{server.url}/v1/sessions/{conversation}").status_code == 204
    for response in (first, second):
        with pytest.raises(openai.NotFoundError):
            server.client.responses.retrieve(response.id)
    with pytest.raises((openai.NotFoundError, openai.BadRequestError)):
        _respond(server, TURNS[2], second.id)
