"""Issue 18: the compose file's proxy (docker/nginx/scale.conf, run by a real nginx with only its upstream
addresses and listen port replaced) in front of two replicas over one PostgreSQL history and one Redis.
A conversation's active KV stays in the replica that ran its last turn, so the proxy must send every turn
of a conversation to that replica: each resumed turn then continues from the KV in memory (restore source
`active`), where one sent to the other replica would recompute the whole history. Conversations still
spread over both replicas."""

import httpx
import openai
import pytest

from benchmarks.harness.nginx_server import NginxProxy, nginx_binary
from benchmarks.harness.openai_server import MAX_TOKENS, TURNS
from benchmarks.harness.replica_server import create_session, post_turn

pytestmark = pytest.mark.skipif(nginx_binary() is None,
                                reason="nginx is not installed: run scripts/install-test-deps.sh")


@pytest.fixture(scope="module")
def proxy(replicas, tmp_path_factory):
    proxy = NginxProxy(tmp_path_factory.mktemp("nginx"), [f"127.0.0.1:{server.port}" for server in replicas]).start()
    yield proxy
    proxy.stop()


def active_on(replicas, session: str) -> list[int]:
    """Which replicas hold the conversation's KV in memory, each asked directly (not through the proxy)."""
    views = [httpx.get(f"{server.url}/v1/sessions/{session}").json() for server in replicas]
    return [i for i, view in enumerate(views) if view["state"] == "active"]


def served_by(replicas, proxy: NginxProxy, session: str) -> set[int]:
    """Which replicas answered the conversation's turns through the proxy (nginx's access log)."""
    ports = [str(server.port) for server in replicas]
    return {ports.index(upstream.rsplit(":", 1)[1]) for method, uri, upstream, _ in proxy.requests()
            if method == "POST" and uri == f"/v1/sessions/{session}/messages"}


def test_every_turn_of_a_conversation_reaches_the_replica_that_holds_its_kv(replicas, proxy):
    """Conversations one after the other, three turns each: consecutive turns of one conversation, so that
    a proxy choosing per request (round robin) sends the second turn to the other replica. Four
    conversations, and more until both replicas have one (the session ids are random), at most 16."""
    sessions = []

    def replicas_used() -> int:
        return len({min(served_by(replicas, proxy, session)) for session in sessions})

    while len(sessions) < 4 or (replicas_used() < 2 and len(sessions) < 16):
        session = create_session(proxy.url)
        sessions.append(session)
        for turn, content in enumerate(TURNS[:3]):
            response = post_turn(proxy.url, session, content)
            assert response.status_code == 200, response.text
            if turn > 0:
                assert response.json()["restore"]["source"] == "active", (session, turn, proxy.requests())
    placed = {}
    for session in sessions:
        assert len(served_by(replicas, proxy, session)) == 1
        placed[session] = active_on(replicas, session)
        assert placed[session] == sorted(served_by(replicas, proxy, session))  # held where its turns ran
    assert {replica for held in placed.values() for replica in held} == {0, 1}, placed  # both replicas used


def converse(client: openai.OpenAI, messages: list[dict], turns: list[str]) -> list:
    """Resends the whole conversation (`messages`, extended in place) each turn, as OpenAI clients do;
    returns each turn's completion."""
    model = client.models.list().data[0].id
    completions = []
    for content in turns:
        messages.append({"role": "user", "content": content})
        completion = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                                    max_tokens=MAX_TOKENS)
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
        completions.append(completion)
    return completions


def test_an_openai_client_that_names_nothing_keeps_its_conversations_on_one_replica(replicas, proxy):
    """Without a session id or a conversation header the client itself is the key (its API key and
    address): all its conversations on one replica, every resumed turn from the KV in memory."""
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="a-client-that-names-nothing", max_retries=0)
    conversations = []
    for opening in (TURNS[0], TURNS[3]):
        completions = converse(client, [], [opening, TURNS[1], TURNS[2]])
        assert len({c.statekeeper["conversation_id"] for c in completions}) == 1  # found again each turn
        assert [c.statekeeper["restore"]["source"] for c in completions[1:]] == ["active", "active"]
        conversations.append(completions[0].statekeeper["conversation_id"])
    assert conversations[0] != conversations[1]
    holders = [active_on(replicas, conversation) for conversation in conversations]
    assert holders[0] == holders[1] and len(holders[0]) == 1, holders


def test_an_openai_client_that_names_its_conversation_reaches_the_replica_of_its_session(replicas, proxy):
    """X-Statekeeper-Conversation names a /v1/sessions conversation: the OpenAI turns go where that
    session's turns went, and continue from its KV in memory."""
    session = create_session(proxy.url)  # its system prompt is "Be brief."
    first = post_turn(proxy.url, session, TURNS[0], max_tokens=MAX_TOKENS)
    assert first.status_code == 200, first.text
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="a-client-that-names-its-conversation",
                           max_retries=0, default_headers={"X-Statekeeper-Conversation": session})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TURNS[0]},
                {"role": "assistant", "content": first.json()["content"]}]
    for completion in converse(client, messages, TURNS[1:3]):
        assert completion.statekeeper["conversation_id"] == session
        assert completion.statekeeper["restore"]["source"] == "active"
    assert active_on(replicas, session) == sorted(served_by(replicas, proxy, session))
