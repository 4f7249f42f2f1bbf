"""Dependencies shared by the routers."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Request

from statekeeper.sessions import SessionService


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


ServiceDep = Annotated[SessionService, Depends(get_service)]
AdminDep = Annotated[None, Depends(require_admin)]
