"""The GPU suite (`make test-gpu`): the service over a CUDA worker, through its HTTP API. The first multi-user run
of the service on a GPU (BENCHMARKS.md, issue 34) found every turn the device restorer restored failing its
answer; the device restorer's own tests had passed, the API's CPU twin runs its CPU reference
(tests/api/test_sessions_api.py)."""

import json

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from tests.gpu.test_device_restore import _worker

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_worker(tiny_model_dir):
    return _worker(tiny_model_dir, "cuda")


def _reply(client, session: str, content: str, stream: bool) -> dict:
    body = {"content": content, "max_tokens": 4, "stream": stream}
    if not stream:
        response = client.post(f"/v1/sessions/{session}/messages", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", f"/v1/sessions/{session}/messages", json=body) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1].get("done") is True, events[-1]
    return events[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_restored_on_the_device_answers_as_the_conversation_that_stayed(make_service, gpu_worker, stream):
    service = make_service(tiers=("dram",), worker=gpu_worker)
    with TestClient(create_app(lambda: service)) as client:
        restored, stayed = (client.post("/v1/sessions", json={}).json()["id"] for _ in range(2))
        for session in (restored, stayed):
            _reply(client, session, "Hello there, how are you today?", stream)
        assert client.post(f"/v1/sessions/{restored}/offload").json()["tier"] == "dram"
        result, expected = (_reply(client, session, "Tell me about Rome.", stream) for session in (restored, stayed))
    assert expected["restore"]["source"] == "active" and result["restore"]["source"] == "dram"
    assert result["content"] == expected["content"]
    device = result["restore"]["device"]
    assert device["fallback"] is None and device["compressed"] is False
    assert device["copied_bytes"] > 0 and device["staged_bytes"] == 0  # in place from the pinned DRAM tier
