"""ASGI middleware that counts every HTTP response by route template, method and status."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "unmatched"  # a path no route serves (404): its text may be anything, so it is not a label
# h11 accepts any method token, and requests are counted before authentication: a label takes its value
# from a closed set, or an unauthenticated client could mint one series per invented method.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
OTHER_METHOD = "other"


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
        method = scope["method"] if scope["method"] in METHODS else OTHER_METHOD
        service.metrics.record_request(_route_template(app, scope), method, status)


def _route_template(app, scope: Scope) -> str:
    """The route FastAPI matched, else (a request answered before routing, or by the docs' own routes)
    the served path template it fits."""
    route = scope.get("route")
    if route is not None:
        return route.path
    path = scope["path"]
    return next((template for pattern, template in _path_templates(app) if pattern.fullmatch(path)), UNMATCHED)


def _path_templates(app) -> list[tuple[re.Pattern, str]]:
    """The API's OpenAPI paths and the docs' routes as patterns ({session_id}: one path segment), built
    once per app."""
    if not hasattr(app.state, "path_templates"):
        templates = [*app.openapi()["paths"], *(route.path for route in app.router.routes if hasattr(route, "path"))]
        app.state.path_templates = [(re.compile(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))), template)
                                    for template in templates]
    return app.state.path_templates
