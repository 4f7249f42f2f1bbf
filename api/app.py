"""The FastAPI application. The session service is built in the lifespan (or handed in by tests)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from api.browser_guard import BrowserGuard
from api.http_metrics import CountRequests
from api.limits import BodySizeLimit
from api.logs import redact_logs
from api.openai import responses as openai_responses
from api.openai import routes as openai_routes
from api.openai.protocol import error_body
from api.streaming import DEFAULT_SEND_SECONDS
from api.routers import admin, health, prometheus, sessions
from statekeeper.sessions import SessionError, SessionService


DASHBOARD_DIR = Path(__file__).parent / "dashboard"  # GET /admin: static files; its data needs the admin token
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # 64 scored messages of 32,000 characters fit with room to spare


def create_app(build_service: Callable[[], SessionService], admin_token: str | None = None,
               close_service: bool = True, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               show_docs: bool = True, auth: str = "none", metrics_public: bool = False,
               allowed_hosts: Sequence[str] | None = None, send_seconds: float = DEFAULT_SEND_SECONDS,
               metrics_token: str | None = None) -> FastAPI:
    """`show_docs=False` (production) serves no /docs, /redoc or /openapi.json; `auth="api_key"` asks every
    /v1 route but /v1/admin for an API key, whose tenant owns what it creates; `metrics_public=True` serves
    /metrics without the admin token; `metrics_token` reads /metrics and nothing else; `allowed_hosts`
    (development mode: api/browser_guard.py) are the Host names the server answers to, None for any;
    `send_seconds` how long a streamed turn waits on a client that does not read (api/streaming.py)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service = build_service()
        app.state.service = service
        await service.start()
        try:
            yield
        finally:
            if close_service:
                await service.stop()

    docs = {} if show_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="statekeeper", version="0.1.0", lifespan=lifespan, **docs)
    app.state.admin_token = admin_token
    redact_logs()
    app.state.auth = auth
    app.state.metrics_public = metrics_public
    app.state.metrics_token = metrics_token
    app.state.send_seconds = send_seconds
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, error_content=_error_content)
    app.add_middleware(BrowserGuard, allowed_hosts=allowed_hosts, error_content=_error_content)
    app.add_middleware(CountRequests)  # added last: the outermost, it counts BodySizeLimit's answers too

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError) -> JSONResponse:
        retry_after = getattr(exc, "retry_after_seconds", None)
        headers = None if retry_after is None else {"Retry-After": str(retry_after)}
        if openai_routes.is_openai_path(request.url.path):  # OpenAI says 400 where statekeeper says 422
            status = 400 if exc.status == 422 else exc.status
            return JSONResponse(status_code=status, content=error_body(status, str(exc)), headers=headers)
        detail = str(exc)
        if exc.status == 422:  # the shape of every other 422 (the schema's HTTPValidationError)
            detail = [{"type": "value_error", "loc": ["body"], "msg": detail}]
        return JSONResponse(status_code=exc.status, content={"detail": detail}, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if openai_routes.is_openai_path(request.url.path):
            code = "invalid_api_key" if exc.status_code == 401 else None
            return JSONResponse(status_code=exc.status_code, content=error_body(exc.status_code, str(exc.detail), code=code),
                                headers=exc.headers)
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes each error's input: a 5 MB body came back whole, and a NaN, which
        # cannot be written as JSON, turned the 422 into a 500. Where and why is enough.
        errors = [{key: error[key] for key in ("type", "loc", "msg") if key in error} for error in exc.errors()]
        if openai_routes.is_openai_path(request.url.path):
            first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
            param = ".".join(str(part) for part in first.get("loc", ())[1:]) or None  # without "body"
            message = f"{param}: {first['msg']}" if param else first["msg"]
            return JSONResponse(status_code=400, content=error_body(400, message, param=param))
        return JSONResponse(status_code=422, content={"detail": jsonable_encoder(errors)})

    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(prometheus.router)
    app.include_router(sessions.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_responses.router)

    @app.get("/admin", include_in_schema=False)
    async def admin_page(request: Request) -> RedirectResponse:
        query = request.url.query  # the page's options (?poll_ms=) go with it
        return RedirectResponse("/admin/" + (f"?{query}" if query else ""))

    app.mount("/admin/", StaticFiles(directory=DASHBOARD_DIR, html=True), name="admin")
    return app


def _error_content(path: str, status: int, message: str) -> dict:
    """An error's body as the path's clients read it: OpenAI's shape on OpenAI paths, else {"detail"}."""
    return error_body(status, message) if openai_routes.is_openai_path(path) else {"detail": message}
