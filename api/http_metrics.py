"""ASGI middleware that counts every HTTP response by route template, method and status."""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"  # a path no route serves (404): its text may be anything, so it is not a label


class CountRequests:
    """Outermost, so that it also counts what other middleware answers itself (BodySizeLimit's 413). The
    route is the matched route's path template, never the request's path: session ids stay out of the
    labels (api/logs.py keeps them out of the logs for the same reason)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def sent(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sent)
        except Exception:
            status = status or 500  # what the server's error middleware answers
            raise
        finally:
            if status is not None:  # else the client left before an answer began
                _record(scope, status)


def _record(scope: Scope, status: int) -> None:
    app = scope["app"]
    service = getattr(app.state, "service", None)
    if service is not None:
        service.metrics.record_request(_route_template(app, scope), scope["method"], status)


def _route_template(app, scope: Scope) -> str:
    """The route FastAPI matched; for a request answered before routing, the route that would have."""
    route = scope.get("route")
    if route is None:
        matched = (candidate for candidate in app.router.routes if candidate.matches(scope)[0] != Match.NONE)
        route = next(matched, None)
    return getattr(route, "path", UNMATCHED)
