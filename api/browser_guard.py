"""ASGI middleware against what a web page in the user's browser can make it send (issue 28).

Loopback is not a boundary for a browser: any page can send requests to 127.0.0.1, and a page whose own
name is rebound to 127.0.0.1 (DNS rebinding) even reads the answers. Without API keys (development mode)
nothing else stands in its way, so:
- every request must name this server in its Host header (`allowed_hosts`: the listen address, the
  loopback names and STATEKEEPER_ALLOWED_HOSTS): a rebound page's requests carry the page's own name;
- a request that changes something (not GET, HEAD or OPTIONS) and says it comes from a page (`Origin`)
  must come from a page of this server, as the dashboard does;
- in every mode, a request body must be sent as JSON: a page may POST text/plain to any address without
  asking the browser's CORS preflight first, never application/json."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from api.limits import send_json

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _hostname(authority: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'; '' for one that does not parse ('[::1')."""
    try:
        return (urlsplit(f"//{authority}").hostname or "").lower()
    except ValueError:
        return ""


def _authority(url: str) -> str | None:
    """An Origin header's host and port, lower case; None for one that does not parse."""
    try:
        return urlsplit(url).netloc.lower()
    except ValueError:
        return None


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class BrowserGuard:
    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] | None = None,
                 error_content: Callable[[str, int, str], dict] = lambda path, status, message: {"detail": message}):
        """`allowed_hosts`: Host names this server answers to (development mode), or None for any (with API
        keys, or behind a proxy that checks them)."""
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {name.strip("[]").lower() for name in allowed_hosts}
        self.error_content = error_content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message = refusal
        await send_json(send, status, self.error_content(scope["path"], status, message))

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        method = scope["method"]
        has_body = headers.get("content-length", "0") not in ("", "0") or "transfer-encoding" in headers
        if method not in SAFE_METHODS and has_body and not _is_json(headers.get("content-type", "")):
            return 415, "send the request body as application/json"
        if self.allowed_hosts is None:
            return None
        host = _hostname(headers.get("host", ""))
        if host not in self.allowed_hosts:
            return 400, "this server does not answer to that Host name (set STATEKEEPER_ALLOWED_HOSTS)"
        origin = headers.get("origin")  # "null" from a sandboxed page or a file: also another site
        if method not in SAFE_METHODS and origin is not None and \
                _authority(origin) != headers.get("host", "").lower():
            return 403, "requests from other sites' pages are refused without API keys"
        return None
