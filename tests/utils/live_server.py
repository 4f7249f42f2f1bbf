"""The service under uvicorn on a free loopback port, in a thread of the test process: what a real client
(httpx, the openai SDK, schemathesis) talks to over HTTP."""

from __future__ import annotations

import contextlib
import threading
import time

import uvicorn

from api.app import create_app
from tests.utils.redis_server import free_port


@contextlib.contextmanager
def live_server(service, log_level: str = "warning", **app_options):
    """Yields the base URL of `service` served by uvicorn; the service is closed by its own fixture."""
    port = free_port()
    app = create_app(lambda: service, close_service=False, **app_options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
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
