"""Issue 28: a conversation deleted on one replica is gone at once from every replica's answers and from
every tier, and stays gone: the other replica, which held it in memory, neither serves its copy nor writes
its KV back into the shared Redis; its stored /v1/responses go with it."""

import httpx
import redis

from benchmarks.harness.replica_server import create_session, post_turn

TURNS = ["Hello, how are you today?", "Tell me about the history of Rome."]


def blob_count(redis_url: str, prefix: str) -> int:
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for _ in client.scan_iter(match=f"{prefix}{{*}}:meta"))
    finally:
        client.close()


def test_a_conversation_deleted_on_a_is_gone_from_b_and_from_redis(start_replicas, postgres_dsn, redis_server, tmp_path):
    a, b = start_replicas(postgres_dsn)
    prefix = a.settings["REDIS_KEY_PREFIX"]
    session = create_session(a.url)
    assert post_turn(a.url, session, TURNS[0]).status_code == 200
    assert httpx.post(f"{a.url}/v1/sessions/{session}/offload").json()["tier"] == "redis"
    assert post_turn(b.url, session, TURNS[1]).status_code == 200  # B now holds it in memory
    assert httpx.get(f"{b.url}/v1/sessions/{session}").json()["state"] == "active"

    assert httpx.delete(f"{a.url}/v1/sessions/{session}").status_code == 204

    for url in (b.url, a.url):
        assert httpx.get(f"{url}/v1/sessions/{session}").status_code == 404
        assert httpx.get(f"{url}/v1/sessions/{session}/messages").status_code == 404
        assert httpx.post(f"{url}/v1/sessions/{session}/offload").status_code == 404
        assert post_turn(url, session, "Still there?").status_code == 404
    assert blob_count(redis_server.url, prefix) == 0


def test_stored_responses_go_with_their_deleted_conversation(start_replicas, postgres_dsn):
    a, b = start_replicas(postgres_dsn)
    model = httpx.get(f"{a.url}/v1/models").json()["data"][0]["id"]
    response = httpx.post(f"{a.url}/v1/responses", json={"model": model, "input": TURNS[0], "max_output_tokens": 4},
                          timeout=60)
    assert response.status_code == 200, response.text
    created = response.json()
    conversation = created["statekeeper"]["conversation_id"]
    for url in (a.url, b.url):
        assert httpx.get(f"{url}/v1/responses/{created['id']}").status_code == 200
    assert httpx.delete(f"{b.url}/v1/sessions/{conversation}").status_code == 204
    for url in (a.url, b.url):
        assert httpx.get(f"{url}/v1/responses/{created['id']}").status_code == 404
    follow_up = httpx.post(f"{a.url}/v1/responses", json={"model": model, "input": "And then?",
                                                          "previous_response_id": created["id"]}, timeout=60)
    assert follow_up.status_code in (400, 404)
