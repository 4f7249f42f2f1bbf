"""Admission control (issue 14 item 5): past `max_concurrent_turns`, a turn is refused at once with 429 and
Retry-After instead of queueing without bound; nothing of the refused conversation changes."""

import threading
import time

from fastapi.testclient import TestClient

from api.app import create_app


def test_a_turn_over_the_concurrency_limit_gets_429_with_retry_after(make_service, monkeypatch):
    service = make_service(max_concurrent_turns=1)
    decoding, release = threading.Event(), threading.Event()
    step = service.worker.step

    def held_step(*args):
        decoding.set()
        release.wait(10)
        return step(*args)

    with TestClient(create_app(lambda: service)) as client:
        busy, waiting = (client.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
        monkeypatch.setattr(service.worker, "step", held_step)
        results = {}
        first = threading.Thread(target=lambda: results.setdefault("busy", client.post(
            f"/v1/sessions/{busy}/messages", json={"content": "Hello", "max_tokens": 3})))
        first.start()
        assert decoding.wait(10)
        refused = client.post(f"/v1/sessions/{waiting}/messages", json={"content": "Hello", "max_tokens": 3})
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert "turns" in refused.json()["detail"]
        release.set()
        first.join(10)
        monkeypatch.setattr(service.worker, "step", step)
        assert results["busy"].status_code == 200
        assert client.get(f"/v1/sessions/{waiting}/messages").json()["data"] == []
        accepted = client.post(f"/v1/sessions/{waiting}/messages", json={"content": "Hello", "max_tokens": 3})
        assert accepted.status_code == 200, accepted.text
