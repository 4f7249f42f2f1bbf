"""Dependencies shared by the routers."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from statekeeper.history import HistoryUnavailable
from statekeeper.sessions import SessionService
from statekeeper.tenancy import DEFAULT_TENANT


def get_service(request: Request) -> SessionService:
    return request.app.state.service


def require_admin(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """Admin endpoints need `Authorization: Bearer <STATEKEEPER_ADMIN_TOKEN>`; without a configured
    token they are disabled."""
    token = request.app.state.admin_token
    if not token:
        raise HTTPException(status_code=403, detail="admin API disabled: set STATEKEEPER_ADMIN_TOKEN")
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
        raise HTTPException(status_code=401, detail="admin token required", headers={"WWW-Authenticate": "Bearer"})


def require_metrics_reader(request: Request, authorization: Annotated[str | None, Header()] = None) -> None:
    """/metrics needs the metrics token (METRICS_TOKEN: it reads metrics and nothing else, so the scraper
    that holds it cannot mint API keys) or the admin token, unless METRICS_PUBLIC opens it to whoever
    reaches the port (a scraper inside a private network): it names no conversation, but tells how busy
    the service is."""
    if request.app.state.metrics_public:
        return
    token = request.app.state.metrics_token
    scheme, _, given = (authorization or "").partition(" ")
    if token and scheme.lower() == "bearer" and secrets.compare_digest(given.encode(), token.encode()):
        return
    require_admin(request, authorization)


def current_tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The tenant of the request's API key (`Authorization: Bearer sk-...`); without API keys (AUTH=none)
    everything belongs to the one default tenant. The request counts toward the tenant's requests per
    minute (429 past them)."""
    service = get_service(request)
    tenant = DEFAULT_TENANT if request.app.state.auth == "none" else _tenant_of_key(service, authorization)
    service.admit_request(tenant)
    return tenant


def _tenant_of_key(service: SessionService, authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    try:
        tenant = service.records.tenant_of_key(key) if scheme.lower() == "bearer" else None
    except HistoryUnavailable:  # the replicas' shared database is down: say so, not "invalid key"
        raise HTTPException(status_code=503, detail="API keys cannot be checked now: try again later",
                            headers={"Retry-After": "2"}) from None
    if tenant is None:
        raise HTTPException(status_code=401, detail="a valid API key is required (Authorization: Bearer sk-...)",
                            headers={"WWW-Authenticate": "Bearer"})
    return tenant


ServiceDep = Annotated[SessionService, Depends(get_service)]
AdminDep = Annotated[None, Depends(require_admin)]
MetricsReaderDep = Annotated[None, Depends(require_metrics_reader)]
TenantDep = Annotated[str, Depends(current_tenant)]
