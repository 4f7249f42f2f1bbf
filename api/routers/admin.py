"""/v1/admin: operator views, behind the admin token."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Response, status

from api.deps import AdminDep, ServiceDep
from api.schemas import (ConversationPage, ConversationRow, Forecast, TierMove, KeyCreate, KeyCreated, KeyList, KeyPublic,
                         RetentionOptions, RetentionPublic, SessionPublic, StatsHistoryPublic, StorageStats,
                         TenantLimitsPublic, TenantList, TenantRetention, TenantUsage, error_responses)

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses=error_responses(401, 403, 413))


@router.get("/tiers", response_model=StorageStats)
async def read_tiers(service: ServiceDep, _: AdminDep) -> StorageStats:
    return StorageStats(**service.stats())


@router.get("/tenants", response_model=TenantList)
async def read_tenants(service: ServiceDep, _: AdminDep) -> TenantList:
    """Each tenant's limits (the same for all; 0: none) and what every tenant with a conversation uses."""
    limits, usage = await service.readouts.tenant_usage()
    return TenantList(limits=TenantLimitsPublic(**asdict(limits)),
                      data=[TenantUsage(**row) for row in usage], retention=service.retention.tenant_defaults)


TenantPath = Annotated[str, Path(pattern=r"^(\*|[A-Za-z0-9][A-Za-z0-9_.-]{0,63})$")]  # TENANT_PATTERN, or "*"


@router.put("/tenants/{tenant}/retention", response_model=TenantRetention)
async def set_tenant_retention(tenant: TenantPath, body: RetentionOptions, service: ServiceDep,
                               _: AdminDep) -> TenantRetention:
    """Replaces the tenant's retention defaults ("*": every tenant's) for its conversations' stored KV, on
    every replica within a sweep; an empty body: STATEKEEPER_TENANT_RETENTION's apply again."""
    applies = await service.set_tenant_retention(tenant, body.settings())
    return TenantRetention(tenant=tenant, settings=RetentionOptions(**(body.settings() or {})),
                           applies=RetentionPublic(**asdict(applies)))


@router.post("/keys", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
async def create_key(body: KeyCreate, service: ServiceDep, _: AdminDep) -> KeyCreated:
    """A new API key for the tenant; the key is in this answer only."""
    record, key = await service.records.create_key(body.tenant)  # LMDB or PostgreSQL
    return KeyCreated(**asdict(record), key=key)


@router.get("/keys", response_model=KeyList)
async def list_keys(service: ServiceDep, _: AdminDep) -> KeyList:
    return KeyList(data=[KeyPublic(**asdict(record)) for record in await service.records.list_keys()])


@router.delete("/keys/{key_id}", status_code=status.HTTP_204_NO_CONTENT, responses=error_responses(404))
async def revoke_key(key_id: Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{8}$")], service: ServiceDep,
                     _: AdminDep) -> Response:
    if not await service.records.revoke_key(key_id):
        raise HTTPException(status_code=404, detail="no such key")
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# -- the dashboard (GET /admin): its table, its actions and its charts --------------------------------------

SessionIdPath = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


@router.get("/forecast", response_model=Forecast)
async def read_forecast(service: ServiceDep, _: AdminDep) -> Forecast:
    """What halving, doubling or quadrupling every tier would do to the recent traffic's hit rate and first
    tokens: its turns replayed through the placement simulator (seconds of CPU: ask, do not poll)."""
    return Forecast(**await service.readouts.forecast())


@router.put("/conversations/{session_id}/retention", response_model=SessionPublic, responses=error_responses(404))
async def set_conversation_retention(session_id: SessionIdPath, body: RetentionOptions, service: ServiceDep,
                                     _: AdminDep) -> SessionPublic:
    """Any tenant's conversation: replaces its own retention settings (an empty body: its tenant's apply)."""
    return SessionPublic(**asdict(await service.set_retention(session_id, body.settings(), tenant=None)))


@router.get("/conversations", response_model=ConversationPage)
async def list_conversations(service: ServiceDep, _: AdminDep,
                             prefix: Annotated[str, Query(pattern=r"^[A-Za-z0-9_-]{0,64}$")] = "",
                             after: Annotated[str, Query(pattern=r"^[A-Za-z0-9_-]{0,64}$")] = "",
                             limit: Annotated[int, Query(ge=1, le=200)] = 50) -> ConversationPage:
    """Every tenant's conversations in id order, `limit` at a time: those whose id starts with `prefix`,
    after the id `after` (the previous page's `next_after`)."""
    rows, next_after = await service.readouts.conversation_page(prefix, after, limit)
    return ConversationPage(data=[ConversationRow(**row) for row in rows], next_after=next_after)


async def _row(service, session_id: str) -> ConversationRow:
    rows = await service.readouts.conversation_rows(session_id, "", 1)
    if not rows or rows[0]["id"] != session_id:
        raise HTTPException(status_code=404, detail=f"session {session_id} not found")
    return ConversationRow(**rows[0])


@router.post("/conversations/{session_id}/offload", response_model=ConversationRow, responses=error_responses(404, 409))
async def offload_conversation(session_id: SessionIdPath, service: ServiceDep, _: AdminDep) -> ConversationRow:
    """Stores the conversation's KV in the fastest tier with room and frees it from the worker."""
    await service.offload(session_id, tenant=None)
    return await _row(service, session_id)


@router.post("/conversations/{session_id}/move", response_model=ConversationRow, responses=error_responses(404))
async def move_conversation(session_id: SessionIdPath, body: TierMove, service: ServiceDep, _: AdminDep) -> ConversationRow:
    """Moves the conversation's stored KV to the named tier (or the next slower one with room)."""
    await service.move(session_id, body.tier, tenant=None)
    return await _row(service, session_id)


@router.post("/conversations/{session_id}/prefetch", response_model=ConversationRow, responses=error_responses(404))
async def prefetch_conversation(session_id: SessionIdPath, service: ServiceDep, _: AdminDep) -> ConversationRow:
    """Moves the conversation's stored KV to the fastest tier with room, ahead of its next turn."""
    await service.prefetch(session_id, tenant=None)
    return await _row(service, session_id)


@router.delete("/conversations/{session_id}", status_code=status.HTTP_204_NO_CONTENT,
               responses=error_responses(404, 409))
async def delete_conversation(session_id: SessionIdPath, service: ServiceDep, _: AdminDep) -> Response:
    """Deletes the conversation: its history and every stored KV state."""
    await service.delete(session_id, tenant=None)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/history", response_model=StatsHistoryPublic)
async def read_history(service: ServiceDep, _: AdminDep) -> StatsHistoryPublic:
    """The dashboard's charts: samples of the stats, one every `interval_s`, for the last `window_s`
    (in memory only), and each tier's codec."""
    return StatsHistoryPublic(**service.readouts.stats_history())
