"""ASGI middleware that bounds a request body before anything reads it."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """Refuses a request body over `max_bytes` with 413: at once when its Content-Length says so, else as
    soon as the chunks received pass it (a chunked upload declares no length), so an oversized body is
    never buffered whole. The app parses bodies before it answers, so nothing has been sent by then.
    `error_content(path, status, message)` shapes the refusal where the app's own handlers do not run (the
    app turns the chunked case's HTTPException into its usual error, OpenAI's shape on OpenAI paths)."""

    def __init__(self, app: ASGIApp, max_bytes: int,
                 error_content: Callable[[str, int, str], dict] = lambda path, status, message: {"detail": message}):
        self.app = app
        self.max_bytes = max_bytes
        self.error_content = error_content

    def _detail(self) -> str:
        return f"request body over {self.max_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await send_json(send, 413, self.error_content(scope["path"], 413, self._detail()))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI turns it into the 413 response
                    raise HTTPException(413, self._detail())
            return message

        await self.app(scope, counted, send)


async def send_json(send: Send, status: int, content: dict) -> None:
    """An answer sent by a middleware, before the app has seen the request."""
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
