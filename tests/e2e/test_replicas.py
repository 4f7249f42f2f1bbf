"""Issue 18: two statekeeper processes share one PostgreSQL history and one Redis. A conversation goes on
on either replica, token for token as if it had stayed on one; both hammered on one conversation run one
turn at a time, and the history never forks."""

import threading

import httpx
import psycopg

from statekeeper.history.postgres import PostgresHistory
from benchmarks.harness.openai_server import Server
from benchmarks.harness.replica_server import create_session, post_turn

TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
         "Name three rivers.", "Which is the longest?"]


def _history(replicas):
    dsn = replicas[0].settings["POSTGRES_DSN"]
    return PostgresHistory(dsn, pool_size=1)


def test_a_conversation_started_on_a_continues_on_b_token_for_token(replicas):
    a, b = replicas
    moved, uninterrupted = create_session(a.url), create_session(a.url)
    for turn, content in enumerate(TURNS):
        here = (a, b)[turn % 2]  # A, B, A, B, A: each replica takes up what the other committed
        moved_reply = post_turn(here.url, moved, content)
        plain_reply = post_turn(a.url, uninterrupted, content)
        assert moved_reply.status_code == plain_reply.status_code == 200
        got, expected = moved_reply.json(), plain_reply.json()
        assert (got["content"], got["usage"]["prompt_tokens"], got["usage"]["completion_tokens"]) == (
            expected["content"], expected["usage"]["prompt_tokens"], expected["usage"]["completion_tokens"])
    history = _history(replicas)
    try:
        assert history.load(moved).tokens == history.load(uninterrupted).tokens  # the exact token ids
        assert history.load(moved).turns == len(TURNS)
    finally:
        history.close()
    # Either replica reads the same conversation.
    assert httpx.get(f"{a.url}/v1/sessions/{moved}/messages").json() == \
        httpx.get(f"{b.url}/v1/sessions/{moved}/messages").json()


def test_both_replicas_hammered_on_one_conversation_run_one_turn_at_a_time(replicas):
    session = create_session(replicas[0].url)
    answered, refused, usage, lock = [], [], {}, threading.Lock()

    def client(number: int):
        for attempt in range(4):
            content = f"Client {number} asks question {attempt}."
            response = post_turn(replicas[(number + attempt) % 2].url, session, content, max_tokens=6)
            with lock:
                if response.status_code == 200:
                    answered.append((content, response.json()["content"]))
                    usage[content] = response.json()["usage"]
                else:
                    assert response.status_code in (409, 429), response.text  # leased elsewhere, busy here
                    refused.append(content)

    clients = [threading.Thread(target=client, args=(number,)) for number in range(6)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    assert answered, "no turn ran"
    history = _history(replicas)
    try:
        stored = history.load(session)
    finally:
        history.close()
    # No fork: every answered turn is in the history exactly once, with the reply its client got, and
    # nothing of a refused one; roles alternate, one turn after the other.
    pairs = [(stored.messages[i]["content"], stored.messages[i + 1]["content"])
             for i in range(0, len(stored.messages), 2)]
    assert [m["role"] for m in stored.messages] == ["user", "assistant"] * len(answered)
    assert sorted(pairs) == sorted(answered)
    assert not set(refused) & {user for user, _ in pairs}
    # Exactly one turn at a time: each turn's prompt held every turn committed before it, replies included
    # (none was computed beside another, from the same history).
    for (before, _), (after, _) in zip(pairs, pairs[1:]):
        assert usage[after]["prompt_tokens"] > usage[before]["prompt_tokens"] + usage[before]["completion_tokens"]
    assert refused, "the clients never met: nothing was tested"
    with psycopg.connect(replicas[0].settings["POSTGRES_DSN"]) as connection:
        turns, fence = connection.execute("SELECT turns, fence FROM conversations WHERE id = %s", (session,)).fetchone()
    assert turns == len(answered) and fence is not None


def test_an_openai_client_alternating_replicas_stays_in_one_conversation(replicas):
    """A client that resends its messages, sent to A and B in turn: each replica finds the conversation by
    its messages in the shared index and continues it, even when its own copy in memory is behind."""
    clients = [Server(replica.url) for replica in replicas]
    messages, ids = [], set()
    for turn, content in enumerate(TURNS[:4]):
        messages.append({"role": "user", "content": content})
        completion = clients[turn % 2].ask(messages)
        messages.append({"role": "assistant", "content": completion.choices[0].message.content})
        ids.add(completion.statekeeper["conversation_id"])
    assert len(ids) == 1
