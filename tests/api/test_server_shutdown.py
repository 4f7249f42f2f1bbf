"""A shutdown (SIGTERM) under uvicorn as `statekeeper serve` runs it (api/server.py): requests under way get
DRAIN_SECONDS to finish, then they are cancelled and the service stores its active states (SHUTDOWN_SECONDS)."""

import threading
import time

import httpx

from benchmarks.harness.live_server import live_server


def test_a_shutdown_waits_for_a_streaming_turn_only_drain_seconds(make_service, monkeypatch):
    """uvicorn waited for every request under way with no bound before the service's own shutdown began: a
    long streaming turn outlasted Docker's stop timeout, whose SIGKILL then lost every active state."""
    service = make_service(tiers=("dram",))
    step = service.worker.step
    monkeypatch.setattr(service.worker, "step", lambda *args: time.sleep(0.1) or step(*args))
    streaming = threading.Event()

    def stream(url: str) -> None:
        try:
            with httpx.Client(timeout=60) as client:
                session = client.post(f"{url}/v1/sessions", json={}).json()["id"]
                body = {"content": "Tell me a long story.", "max_tokens": 200, "stream": True}
                with client.stream("POST", f"{url}/v1/sessions/{session}/messages", json=body) as response:
                    assert response.status_code == 200
                    for _ in response.iter_lines():
                        streaming.set()
        except httpx.HTTPError:
            pass  # the server went away mid-reply

    with live_server(service, drain_seconds=1.0) as url:  # the turn would take 20 s
        client = threading.Thread(target=stream, args=(url,), daemon=True)
        client.start()
        assert streaming.wait(30)
        stopping = time.monotonic()
    assert time.monotonic() - stopping < 5.0
    client.join(10)
    assert not client.is_alive()
