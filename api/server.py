"""How uvicorn serves the app, with bounds on what one client's connections can hold (issue 28).

uvicorn's h11 protocol waits for a request's headers without a deadline (a client that sends them a byte
at a time holds its connection forever), and closes a connection whose response was given up by waiting
to flush bytes the client never reads. Here:
- a request's headers must arrive within `header_seconds` of the connection opening or of the previous
  response ending, else the connection is dropped;
- a response that gave up on its client (api/streaming.py: a streamed turn whose client stopped reading)
  marks its scope, and its connection is then aborted, not left to flush;
- each connection's kernel send buffer is fixed at `send_buffer_bytes`: Linux otherwise grows it up to
  tcp_wmem's maximum (4 MiB), more than a whole reply, so a client that stops reading was never noticed
  (benchmarks/abuse.py: no send ever waited); a token stream needs far less at any distance;
- a streamed turn may ask whether its client is behind (`CLIENT_BEHIND` in the request's scope): more than
  half a send buffer sent and not acknowledged by the client's kernel (the kernel's send queue, SIOCOUTQ, and
  asyncio's buffer above it). A client that stopped reading is noticed after that much, not once every
  buffer on the way is full (168 tokens of OpenAI chunks, 43 KB, on loopback: tests/api/test_slow_clients.py);
- at most `max_connections` connections (uvicorn's limit_concurrency: 503 above it)."""

from __future__ import annotations

import asyncio
import fcntl
import socket
import struct
import termios

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

GAVE_UP = "statekeeper.gave_up_on_client"  # set in a request's scope by a response that stopped sending
CLIENT_BEHIND = "statekeeper.client_is_behind"  # in a request's scope: () -> bool


def _unacknowledged_in_kernel(connection) -> int:
    """Bytes in the socket's send queue not yet acknowledged by the peer (Linux's SIOCOUTQ); 0 where the
    platform does not say."""
    try:
        return struct.unpack("i", fcntl.ioctl(connection.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, AttributeError, ValueError):
        return 0


class _AbortingTransport:
    """The connection's transport, closed by aborting when its last response gave up on the client."""

    def __init__(self, transport: asyncio.Transport, protocol: "GuardedH11Protocol"):
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        scope = getattr(self._protocol, "scope", None)
        if scope and scope.get(GAVE_UP):
            self._transport.abort()  # what is buffered is for a client that does not read it
        else:
            self._transport.close()

    def __getattr__(self, name):
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    header_seconds: float = 10.0
    send_buffer_bytes: int = 16 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        connection = transport.get_extra_info("socket")
        if connection is not None and connection.family in (socket.AF_INET, socket.AF_INET6):
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            # and what asyncio buffers above the kernel before a send waits: the same again, not 64 KiB
            transport.set_write_buffer_limits(high=self.send_buffer_bytes)
        super().connection_made(_AbortingTransport(transport, self))  # type: ignore[arg-type]
        self._await_headers()

    def _await_headers(self) -> None:
        self._stop_waiting()
        self._header_deadline = self.loop.call_later(self.header_seconds, self._headers_too_slow)

    def _stop_waiting(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        if not self.transport.is_closing():
            self.transport.abort()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers have arrived; its app task has not started yet
            self._stop_waiting()
            self.scope[CLIENT_BEHIND] = self._client_is_behind

    def _client_is_behind(self) -> bool:
        connection = self.transport.get_extra_info("socket")
        unacknowledged = self.transport.get_write_buffer_size()
        if connection is not None:
            unacknowledged += _unacknowledged_in_kernel(connection)
        return unacknowledged > self.send_buffer_bytes // 2

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may start serving a request that was pipelined behind this one
        if not self.transport.is_closing() and self.cycle is cycle:
            self._await_headers()  # the next request's, on a kept-alive connection (not one already running)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)


def server_config(app, host: str, port: int, *, header_seconds: float, max_connections: int, drain_seconds: float,
                  send_buffer_bytes: int = GuardedH11Protocol.send_buffer_bytes, log_level: str = "info",
                  **options) -> uvicorn.Config:
    """`drain_seconds`: at a shutdown, how long requests under way may take before they are cancelled and the
    service's own shutdown (storing its active states) begins; uvicorn's default waits for them forever."""
    protocol = type("GuardedH11Protocol", (GuardedH11Protocol,),
                    {"header_seconds": header_seconds, "send_buffer_bytes": send_buffer_bytes})
    return uvicorn.Config(app, host=host, port=port, http=protocol, limit_concurrency=max_connections,
                          log_level=log_level, timeout_graceful_shutdown=drain_seconds, **options)
