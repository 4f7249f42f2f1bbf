"""/v1/admin: operator views, behind the admin token."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Response, status

from api.deps import AdminDep, ServiceDep
from api.schemas import (KeyCreate, KeyCreated, KeyList, KeyPublic, StorageStats, TenantLimitsPublic, TenantList,
                         TenantUsage, error_responses)

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=error_responses(401, 403, 413))


@router.get("/tiers", response_model=StorageStats)
async def read_tiers(service: ServiceDep, _: AdminDep) -> StorageStats:
    return StorageStats(**service.stats())


@router.get("/tenants", response_model=TenantList)
async def read_tenants(service: ServiceDep, _: AdminDep) -> TenantList:
    """Each tenant's limits (the same for all; 0: none) and what every tenant with a conversation uses."""
    usage = await service.in_io_thread(service.tenants.usage)
    return TenantList(limits=TenantLimitsPublic(**asdict(service.tenants.limits)),
                      data=[TenantUsage(**row) for row in usage])


@router.post("/keys", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
async def create_key(body: KeyCreate, service: ServiceDep, _: AdminDep) -> KeyCreated:
    """A new API key for the tenant; the key is in this answer only."""
    record, key = service.keys.create(body.tenant)
    return KeyCreated(**asdict(record), key=key)


@router.get("/keys", response_model=KeyList)
async def list_keys(service: ServiceDep, _: AdminDep) -> KeyList:
    return KeyList(data=[KeyPublic(**asdict(record)) for record in service.keys.list()])


@router.delete("/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(404))
async def revoke_key(key_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{8}$")], service: ServiceDep,
                     _: AdminDep) -> Response:
    if not service.keys.revoke(key_id):
        raise HTTPException(status_code=404, detail="no such key")
    return Response(status_code=status.HTTP_204_NO_CONTENT)
