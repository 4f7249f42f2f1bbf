"""What both streaming APIs share: a turn's events after its 200 went out, and the response that sends
them with a deadline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.server import CLIENT_BEHIND, GAVE_UP

log = logging.getLogger(__name__)
DEFAULT_SEND_SECONDS = 30.0
ACK_POLL_SECONDS = 0.02  # how often a paused turn looks again whether its client caught up


class _ClientStoppedReading(Exception):
    pass


class TurnStream(StreamingResponse):
    """Server-sent events of a turn. While a send waits on a client that stopped reading, the turn holds
    its conversation, a turn slot, its lease and the pause on compression, and a send waits while the client
    is behind (api/server.py), so such a turn stops decoding early; a send that has not gone out and been
    mostly taken within the app's `send_seconds` ends the turn as a client that left does (nothing committed), and the
    connection is dropped (api/server.py)."""

    def __init__(self, content, **kwargs):
        super().__init__(content, media_type="text/event-stream", **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        seconds = getattr(scope["app"].state, "send_seconds", DEFAULT_SEND_SECONDS)
        client_is_behind = scope.get(CLIENT_BEHIND, lambda: False)

        async def sent_and_read(message) -> None:
            await send(message)
            # The turn's next token waits until the client has taken most of what was sent: one that stopped
            # reading holds a paused turn, not a decoding one, until the deadline ends it.
            while message.get("more_body") and client_is_behind():
                await asyncio.sleep(ACK_POLL_SECONDS)

        async def send_in_time(message) -> None:
            try:
                await asyncio.wait_for(sent_and_read(message), seconds)
            except TimeoutError:
                raise _ClientStoppedReading from None

        try:
            await super().__call__(scope, receive, send_in_time)
        except _ClientStoppedReading:
            scope[GAVE_UP] = True
            log.warning("a streamed turn's client read nothing for %.0f s: turn ended, connection dropped", seconds)
        finally:
            await self.body_iterator.aclose()  # the turn ends now, not when the generator is collected


async def after_the_200(first, events: AsyncIterator) -> AsyncIterator:
    """The turn's events, `first` (already taken, so errors before it were plain HTTP errors) included;
    an exception raised after it is yielded, last, instead of raised: the 200 is already sent, so the
    error can only travel in the stream."""
    yield first
    while True:
        try:
            event = await anext(events)
        except StopAsyncIteration:
            return
        except Exception as exc:
            yield exc
            return
        yield event
