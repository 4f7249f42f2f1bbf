"""/v1/sessions: conversations, their messages (turns) and their storage state."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import asdict

from fastapi import APIRouter, Response, status

from api.deps import ServiceDep, TenantDep
from api.streaming import TurnStream, after_the_200
from api.schemas import (
    MessageCreate,
    ScoreCreate,
    ScorePublic,
    MessageList,
    MessagePublic,
    RetentionOptions,
    SessionCreate,
    SessionCreated,
    SessionId,
    SessionPublic,
    error_responses,
)
from statekeeper.sessions import SessionError, TurnDelta, TurnRequest, TurnResult

log = logging.getLogger(__name__)

# SessionError subclasses become their HTTP status through the app's exception handler (api/app.py).
router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=error_responses(400, 401, 404, 409, 413, 429, 507))


def _message_public(result: TurnResult) -> MessagePublic:
    return MessagePublic.model_validate(
        {
            "content": result.content,
            "reasoning": result.reasoning,
            "usage": {
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "cached_tokens": result.cached_tokens,
            },
            "restore": {"source": result.restore_source, "ms": round(result.restore_ms, 3),
                        "pipeline": result.restore_pipeline, "layerwise": result.restore_layerwise,
                        "device": result.restore_device,
                        "exact_copy": result.restore_exact_copy},
            "timings": {"ttft_ms": round(result.ttft_ms, 3), "total_ms": round(result.total_ms, 3),
                        "lock_wait_ms": round(result.lock_wait_ms, 3),
                        "first_queue_ms": None if result.first_queue_ms is None else round(result.first_queue_ms, 3)},
        }
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=SessionCreated)
async def create_session(body: SessionCreate, service: ServiceDep, tenant: TenantDep) -> SessionCreated:
    compression = body.compression.model_dump(exclude_none=True) if body.compression else None
    retention = body.retention.settings() if body.retention else None
    conversation = await service.create(body.system, body.metadata, compression, tenant, retention=retention)
    return SessionCreated(id=conversation.id, created_at=conversation.created_at)


@router.get("/{session_id}", response_model=SessionPublic)
async def read_session(session_id: SessionId, service: ServiceDep, tenant: TenantDep) -> SessionPublic:
    return SessionPublic(**asdict(await service.view(session_id, tenant)))


@router.delete("/{session_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_session(session_id: SessionId, service: ServiceDep, tenant: TenantDep) -> Response:
    await service.delete(session_id, tenant)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.put("/{session_id}/retention", response_model=SessionPublic)
async def set_session_retention(session_id: SessionId, body: RetentionOptions, service: ServiceDep,
                                tenant: TenantDep) -> SessionPublic:
    """Replaces the conversation's own retention settings (an empty body: its tenant's apply)."""
    return SessionPublic(**asdict(await service.set_retention(session_id, body.settings(), tenant)))


@router.post("/{session_id}/offload", response_model=SessionPublic)
async def offload_session(session_id: SessionId, service: ServiceDep, tenant: TenantDep) -> SessionPublic:
    return SessionPublic(**asdict(await service.offload(session_id, tenant)))


@router.post("/{session_id}/prefetch", response_model=SessionPublic)
async def prefetch_session(session_id: SessionId, service: ServiceDep, tenant: TenantDep) -> SessionPublic:
    return SessionPublic(**asdict(await service.prefetch(session_id, tenant)))


@router.get("/{session_id}/messages", response_model=MessageList)
async def read_messages(session_id: SessionId, service: ServiceDep, tenant: TenantDep) -> MessageList:
    return MessageList(data=await service.messages(session_id, tenant))


@router.post("/{session_id}/score", response_model=ScorePublic)
async def create_score(session_id: SessionId, body: ScoreCreate, service: ServiceDep, tenant: TenantDep) -> ScorePublic:
    """Teacher-forced log-probabilities of the assistant tokens of `messages`, appended to the session's
    current state (restored as a real turn would be); the session itself does not change."""
    result = await service.score(session_id, [m.model_dump() for m in body.messages], tenant)
    decode = service.formatter.decode
    tokens = [
        {"token": t.token, "text": decode([t.token]), "logprob": t.logprob, "greedy_token": t.greedy_token,
         "greedy_text": decode([t.greedy_token]), "match": t.is_match}
        for t in result.tokens
    ]
    totals = {
        "tokens": len(tokens),
        "matches": sum(t["match"] for t in tokens),
        "top1_agreement": result.top1_agreement,
        "mean_logprob": result.mean_logprob,
        "perplexity": math.exp(-result.mean_logprob),
    }
    return ScorePublic.model_validate(
        {"tokens": tokens, "totals": totals, "restore": {"source": result.restore_source, "ms": result.restore_ms}}
    )


# With "stream": true the 200 is server-sent events, each `data` a JSON object: {"delta": text} per
# token, then the MessagePublic with "done": true (or {"error": ...} if the turn failed mid-stream).
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "contentMediaType": "application/json"}}}
STREAMED = {200: {"content": {"text/event-stream": {"itemSchema": SSE_EVENT}},
                  "description": "the reply (JSON), or with stream=true its server-sent events"}}


@router.post("/{session_id}/messages", response_model=MessagePublic, responses=STREAMED)
async def create_message(session_id: SessionId, body: MessageCreate, service: ServiceDep, tenant: TenantDep):
    request = TurnRequest(body.content, body.max_tokens, body.temperature, body.top_p, body.seed)
    events = service.turn(session_id, request, tenant)
    first = await anext(events)  # errors before the first token become plain HTTP errors
    if body.stream:
        return TurnStream(_sse(first, events))
    result = first
    async for event in events:
        result = event
    return _message_public(result)


async def _sse(first, events):
    async with contextlib.aclosing(events):  # a client gone mid-stream ends the turn now, not at GC
        async for event in after_the_200(first, events):
            if isinstance(event, Exception):
                payload = _stream_error(event) | {"done": True}
            elif isinstance(event, TurnDelta):
                payload = {"delta": event.text}
            else:
                payload = _message_public(event).model_dump() | {"done": True}
            yield f"data: {json.dumps(payload)}\n\n"


def _stream_error(exc: Exception) -> dict:
    """What a stream that fails after its 200 says: the service's own refusals (507 ...) as a plain
    response would; anything else only that it failed (its text, paths and hosts, goes to the log)."""
    if isinstance(exc, SessionError):
        return {"error": str(exc), "status": exc.status}
    log.exception("turn failed mid-stream")
    return {"error": "the turn failed; the conversation is as it was before it", "status": 500}
