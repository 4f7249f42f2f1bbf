"""/v1/responses, the text subset of OpenAI's Responses API: the stateful way for a client to resume, by
`previous_response_id` instead of resending the conversation. A response answers a point of one stored
conversation (history.StoredResponse); continuing from it is a turn on that conversation when nothing
came after it, and otherwise (or with other instructions, which OpenAI does not carry over) a new
conversation holding that history, both through SessionService.chat, so the same verified prefix match
decides what state is restored. A response made with `store: false` is not kept."""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Annotated

from fastapi import APIRouter, Path
from fastapi.responses import JSONResponse

from api.deps import ServiceDep, TenantDep
from api.openai.protocol import (RESPONSE_ID_PATTERN, ResponseCreate, ResponseDeleted, ResponseObject, error_body,
                                 retention_of)
from api.openai.routes import ERRORS
from statekeeper.history import StoredResponse
from statekeeper.sessions import SessionNotFound, TurnRequest, TurnResult

router = APIRouter(prefix="/v1/responses", tags=["openai"], responses=ERRORS)

ResponseId = Annotated[str, Path(pattern=RESPONSE_ID_PATTERN)]


def _not_found(response_id: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=404, content=error_body(404, f"Response with id '{response_id}' not found.",
                                                            param=param))


async def _stored(service, response_id: str, tenant: str) -> StoredResponse | None:
    """The tenant's stored response; another tenant's is not found, as one that does not exist."""
    stored = await service.records.load_response(response_id)
    return stored if stored is not None and stored.tenant == tenant else None


@router.post("", response_model=ResponseObject)
async def create_response(body: ResponseCreate, service: ServiceDep, tenant: TenantDep):
    if body.model != service.model_id:
        return JSONResponse(status_code=404, content=error_body(
            404, f"The model `{body.model}` does not exist: this server serves `{service.model_id}`",
            param="model", code="model_not_found"))
    if body.tools and service.formatter.tool_call_format is None:
        return JSONResponse(status_code=400, content=error_body(
            400, f"The model `{service.model_id}`'s chat template has no tools: it cannot be offered functions",
            param="tools", code="tools_not_supported"))
    history, hint = [], body.prompt_cache_key
    if body.previous_response_id is not None:
        previous = await _stored(service, body.previous_response_id, tenant)
        if previous is None:
            return _not_found(body.previous_response_id, "previous_response_id")
        try:
            history = (await service.messages(previous.conversation_id, tenant))[:previous.message_count]
        except SessionNotFound:  # its conversation was deleted since
            return _not_found(body.previous_response_id, "previous_response_id")
        hint = previous.conversation_id
    system = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    messages = system + history + body.input_messages
    request = TurnRequest("", body.max_output_tokens, body.temperature, body.top_p, tools=body.tool_definitions,
                          parse_tool_calls=body.calls_allowed, parallel_tool_calls=body.parallel_tool_calls,
                          retention=retention_of(body.prompt_cache_retention))
    session_id, result, events = await service.chat(messages, request, tenant, hint)
    async with contextlib.aclosing(events):
        async for result in events:
            pass
    response = _response(body, service.model_id, session_id, result)
    if body.store:
        stored = StoredResponse(response.id, tenant, session_id, len(messages) - len(system) + 1,
                                response.model_dump(mode="json"))
        await service.records.save_response(stored)
    return response


@router.get("/{response_id}", response_model=ResponseObject)
async def read_response(response_id: ResponseId, service: ServiceDep, tenant: TenantDep):
    stored = await _stored(service, response_id, tenant)
    return _not_found(response_id) if stored is None else ResponseObject.model_validate(stored.body)


@router.delete("/{response_id}", response_model=ResponseDeleted)
async def delete_response(response_id: ResponseId, service: ServiceDep, tenant: TenantDep):
    """Forgets the response (it can no longer be read or continued from); its conversation stays."""
    if await _stored(service, response_id, tenant) is None:
        return _not_found(response_id)
    await service.records.delete_response(response_id)
    return ResponseDeleted(id=response_id)


def _reasoning(result: TurnResult) -> list[dict]:
    """A reasoning template's think block as the output's first item; none without one."""
    if result.reasoning is None:
        return []
    return [{"type": "reasoning", "id": f"rs_{secrets.token_urlsafe(18)}",
             "content": [{"type": "reasoning_text", "text": result.reasoning}]}]


def _said(result: TurnResult) -> list[dict]:
    """The reply's text as a message item (left out when the reply is calls alone), then one item per call."""
    message = [{"type": "message", "id": f"msg_{secrets.token_urlsafe(18)}", "content": [{"text": result.content}]}]
    calls = [{"type": "function_call", "id": f"fc_{secrets.token_urlsafe(18)}", "call_id": call["id"],
              "name": call["function"]["name"], "arguments": call["function"]["arguments"]}
             for call in result.tool_calls or ()]
    return (message if result.content or not calls else []) + calls


def _response(body: ResponseCreate, model: str, session_id: str, result: TurnResult) -> ResponseObject:
    incomplete = result.finish_reason == "length"  # its own max_output_tokens, the service's limit or the context
    return ResponseObject.model_validate({
        "id": f"resp_{secrets.token_urlsafe(24)}", "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "model": model, "instructions": body.instructions,
        "output": _reasoning(result) + _said(result),
        "tools": body.tools or [], "tool_choice": "auto" if body.calls_allowed else "none",
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id, "store": body.store, "temperature": body.temperature,
        "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "metadata": body.metadata or {},
        "usage": {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                  "total_tokens": result.prompt_tokens + result.completion_tokens,
                  "input_tokens_details": {"cached_tokens": result.cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens}},
        "statekeeper": {"conversation_id": session_id, "ttft_ms": round(result.ttft_ms, 3),
                        "restore": {"source": result.restore_source, "ms": round(result.restore_ms, 3)}},
    })
