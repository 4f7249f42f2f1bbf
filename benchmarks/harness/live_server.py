"""The service under uvicorn on a free loopback port, in a thread of the test process: what a real client
(httpx, the openai SDK, schemathesis) talks to over HTTP."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from api.app import create_app
from api.server import server_config
from benchmarks.harness.redis_server import free_port


@contextlib.contextmanager
def live_server(service, log_level: str = "warning", header_seconds: float = 10.0, max_connections: int = 1000,
                send_buffer_bytes: int = 16 * 1024, sockets=None, drain_seconds: float = 5.0, **app_options):
    """Yields the base URL of `service` served by uvicorn as `statekeeper serve` serves it (api/server.py);
    the service is closed by its own fixture. `sockets`: a listening socket to serve on instead of a port."""
    port = free_port() if sockets is None else sockets[0].getsockname()[1]
    app = create_app(lambda: service, close_service=False, **app_options)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, header_seconds=header_seconds,
                                          max_connections=max_connections, send_buffer_bytes=send_buffer_bytes,
                                          drain_seconds=drain_seconds, log_level=log_level))
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
