"""Dependencies shared by the routers."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from statekeeper.sessions import SessionService


def get_service(request: Request) -> SessionService:
    return request.app.state.service


ServiceDep = Annotated[SessionService, Depends(get_service)]
