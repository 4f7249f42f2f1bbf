"""/v1/admin: operator views, behind the admin token."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import AdminDep, ServiceDep
from api.schemas import StorageStats, error_responses

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=error_responses(401, 403, 413))


@router.get("/tiers", response_model=StorageStats)
async def read_tiers(service: ServiceDep, _: AdminDep) -> StorageStats:
    return StorageStats(**service.stats())
