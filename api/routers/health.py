"""/healthz: the model is loaded and storage is writable."""

from __future__ import annotations

import logging

from fastapi import APIRouter, HTTPException

from api.deps import ServiceDep
from api.schemas import Health, error_responses

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"], responses=error_responses(413, 503))


@router.get("/healthz", response_model=Health)
async def read_health(service: ServiceDep) -> Health:
    try:
        health = await service.readouts.health()
    except Exception:
        # The exception's text (paths, hosts) is for the operator's log, not for whoever polls /healthz.
        log.exception("health check: the history store is not writable")
        raise HTTPException(status_code=503, detail="history store not writable") from None
    return Health(**health)
