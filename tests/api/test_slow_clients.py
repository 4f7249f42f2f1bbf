"""Clients that hold capacity (issue 28, defect 5), with real sockets against the service under uvicorn as
`statekeeper serve` runs it (api/server.py): headers sent a byte at a time, connections opened and left
idle, and a streamed turn whose client stops reading."""

import json
import socket
import time

import httpx

from benchmarks.harness.live_server import live_server

ADMIN = {"Authorization": "Bearer admin-token-0123456789abcdef"}


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def is_closed(sock: socket.socket, within: float) -> bool:
    """Whether the server closed or reset the connection within `within` seconds (what it had sent before
    is read and dropped)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(65536) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        pass
    return False


def send_and_never_read(url: str, completion: dict) -> socket.socket:
    """A streamed chat completion sent from a socket with a small receive buffer, which then reads nothing."""
    payload = json.dumps(completion).encode()
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    stalled.connect(("127.0.0.1", port_of(url)))
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return stalled


def wait_until_no_turn_runs(url: str, seconds: float = 20.0) -> None:
    time.sleep(0.5)  # the turn has started
    deadline = time.monotonic() + seconds
    while httpx.get(f"{url}/v1/admin/tiers", headers=ADMIN).json()["turns_in_progress"] and time.monotonic() < deadline:
        time.sleep(0.2)


def test_headers_that_do_not_arrive_in_time_lose_their_connection(make_service):
    with live_server(make_service(), header_seconds=1.0) as url:
        slow = socket.create_connection(("127.0.0.1", port_of(url)))
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        kept_alive = socket.create_connection(("127.0.0.1", port_of(url)))
        kept_alive.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        kept_alive.settimeout(5)
        assert kept_alive.recv(4096).startswith(b"HTTP/1.1 200")
        kept_alive.sendall(b"GET /healthz HTTP/1.1\r\n")  # the next request on it, as slowly
        assert is_closed(slow, within=3.0) and is_closed(kept_alive, within=3.0)
        assert httpx.get(f"{url}/healthz").status_code == 200


def test_idle_connections_cannot_keep_others_out_for_long(make_service):
    with live_server(make_service(), header_seconds=1.0, max_connections=3) as url:
        idle = [socket.create_connection(("127.0.0.1", port_of(url))) for _ in range(3)]
        time.sleep(0.2)
        assert httpx.get(f"{url}/healthz").status_code == 503  # the cap holds
        time.sleep(1.5)  # their headers' deadline passes
        assert httpx.get(f"{url}/healthz").status_code == 200
        for sock in idle:
            sock.close()


def test_a_streamed_turn_whose_client_stops_reading_lets_go_of_its_conversation(make_service):
    """A greedy reply of the tiny model runs to max_tokens; in OpenAI's chunks (~230 bytes a token) it
    fills the connection's buffers long before: the server's kernel send buffer as `statekeeper serve` sets
    it (16 KiB; left to itself Linux grows it to 4 MiB, more than a whole reply, and a client that stopped
    reading was never noticed), the client's receive buffer small. The native API's stream is the same
    TurnStream."""
    service = make_service()
    with live_server(service, admin_token=ADMIN["Authorization"][7:], send_seconds=1.0) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        messages = [{"role": "user", "content": "Tell me a long story."}]
        stalled = send_and_never_read(url, {"model": model, "stream": True, "max_tokens": 1000, "temperature": 0,
                                            "messages": messages})
        wait_until_no_turn_runs(url)
        assert httpx.get(f"{url}/v1/admin/tiers", headers=ADMIN).json()["turns_in_progress"] == 0
        assert is_closed(stalled, within=5.0)
        # Nothing of the given-up turn was kept: the same messages start a conversation afresh.
        again = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "max_tokens": 2, "temperature": 0,
                                                               "messages": messages}, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_streamed_turn_runs_at_most_half_a_send_buffer_ahead_of_what_its_client_acknowledged(make_service):
    """A client that reads nothing costs the others its turn's decoding until the turn notices. Before, the
    turn decoded until the kernel's send buffer (twice SO_SNDBUF), asyncio's and the client's receive
    buffer were full: 168 tokens of OpenAI chunks here, 14 s of every other user's batch at 8 such clients
    (benchmarks/abuse.py probe 3). Now it waits as soon as half a send buffer is unacknowledged."""
    service = make_service()
    send_buffer = 16 * 1024
    with live_server(service, admin_token=ADMIN["Authorization"][7:], send_seconds=1.0,
                     send_buffer_bytes=send_buffer) as url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        request = {"model": model, "stream": True, "max_tokens": 1000, "temperature": 0,
                   "messages": [{"role": "user", "content": "Tell me a long story."}]}

        def rows() -> int:  # tokens the model thread has run, prompts and decodes
            return httpx.get(f"{url}/v1/admin/tiers", headers=ADMIN).json()["model_thread"]["batch_rows"]

        # A reading client, the same request but for 40 tokens: the prompt's tokens and an event's bytes.
        before = rows()
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=request | {"max_tokens": 40}) as response:
            body = b"".join(response.iter_bytes())
        events = [line for line in body.split(b"\n\n") if line.startswith(b"data: {")]
        smallest_event = min(len(event) + 2 for event in events)
        prompt_tokens = rows() - before - 39  # 40 tokens sampled, the last one never fed back

        before = rows()
        stalled = send_and_never_read(url, request)
        wait_until_no_turn_runs(url)
        decoded = rows() - before - prompt_tokens
        assert is_closed(stalled, within=5.0)
        # What fits in half a send buffer, the client's receive buffer (Linux doubles SO_RCVBUF) and the
        # HTTP headers, in events of at least `smallest_event` bytes; plus the event whose send found it full.
        assert 0 < decoded <= (send_buffer // 2 + 2 * 1024 + 1024) // smallest_event + 2, (decoded, smallest_event)


def test_a_request_pipelined_behind_another_is_not_cut_at_the_header_deadline(make_service):
    """HTTP/1.1 pipelining: the first response's end started serving the request queued behind it, and the
    header deadline was then armed again, over that running request: its connection was reset at
    header_seconds, whatever the turn still had to do."""
    with live_server(make_service(), header_seconds=0.2) as url:
        session = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"content": "Tell me a long story about Rome.", "max_tokens": 200}).encode()
        raw = (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
               + f"POST /v1/sessions/{session}/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
            connection.sendall(raw)
            while received.count(b"HTTP/1.1 ") < 2 or not received.rstrip().endswith(b"}"):
                chunk = connection.recv(65536)
                if not chunk:
                    break
                received += chunk
    assert received.count(b"HTTP/1.1 200") == 2
