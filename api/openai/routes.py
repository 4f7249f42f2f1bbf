"""/v1/chat/completions and /v1/models for OpenAI clients, which resend the whole conversation on every
turn: the service finds the stored conversation those messages continue (SessionService.chat), so the
turn restores its state and prefills only the new messages, and `usage.prompt_tokens_details.
cached_tokens` says how much of the prompt that spared."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse

from api.deps import ServiceDep, TenantDep
from api.streaming import TurnStream, after_the_200
from api.openai.protocol import (ChatCompletion, ChatCompletionChunk, ChatCompletionCreate, ChunkChoice, ChunkDelta,
                                 ErrorResponse, Model, ModelList, StatekeeperInfo, ToolCallDelta, Usage, error_body,
                                 retention_of)
from statekeeper.chat import ReasoningSplitter
from statekeeper.tool_calls import ToolCallStream
from statekeeper.sessions import SessionError, TurnDelta, TurnRequest, TurnResult

log = logging.getLogger(__name__)

OPENAI_PATHS = ("/v1/chat/", "/v1/models", "/v1/responses")
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 507)}
STREAMED = {200: {"content": {"text/event-stream": {}},
                  "description": "the completion (JSON), or with stream=true its chunks as server-sent events"}}

router = APIRouter(prefix="/v1", tags=["openai"], responses=ERRORS)


def is_openai_path(path: str) -> bool:
    """Errors on these paths take OpenAI's shape (api/app.py), which OpenAI's SDKs read."""
    return path.startswith(OPENAI_PATHS)


@router.get("/models", response_model=ModelList)
async def list_models(service: ServiceDep, _: TenantDep) -> ModelList:
    return ModelList(data=[Model(id=service.model_id, created=int(service.started_at))])


@router.post("/chat/completions", response_model=ChatCompletion, responses=STREAMED)
async def create_chat_completion(body: ChatCompletionCreate, service: ServiceDep, tenant: TenantDep,
                                 x_statekeeper_conversation: Annotated[str | None, Header(max_length=64)] = None):
    """`X-Statekeeper-Conversation` (or `prompt_cache_key`) names the conversation to continue first: the
    way to continue a /v1/sessions conversation here, since those are found by id only."""
    if body.model != service.model_id:
        return JSONResponse(status_code=404, content=error_body(
            404, f"The model `{body.model}` does not exist: this server serves `{service.model_id}`",
            param="model", code="model_not_found"))
    tool_format = service.formatter.tool_call_format
    if body.tools and tool_format is None:
        return JSONResponse(status_code=400, content=error_body(
            400, f"The model `{service.model_id}`'s chat template has no tools: it cannot be offered functions",
            param="tools", code="tools_not_supported"))
    request = TurnRequest("", body.reply_limit, body.temperature, body.top_p, body.seed, body.stop_sequences,
                          tools=body.tool_definitions, parse_tool_calls=body.calls_allowed,
                          parallel_tool_calls=body.parallel_tool_calls, template_options=body.chat_template_kwargs,
                          retention=retention_of(body.prompt_cache_retention))
    hint = x_statekeeper_conversation or body.prompt_cache_key
    session_id, first, events = await service.chat([m.as_history() for m in body.messages], request, tenant, hint)
    completion = _Completion(id=f"chatcmpl-{secrets.token_urlsafe(18)}", model=service.model_id,
                             conversation_id=session_id, splitter=service.formatter.reasoning_splitter(body.chat_template_kwargs),
                             calls=ToolCallStream(tool_format) if body.calls_allowed else None)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return TurnStream(completion.stream(first, events, include_usage))
    result = first
    async with contextlib.aclosing(events):
        async for result in events:
            pass
    return completion.whole(result)


class _Completion:
    """One completion's identity and how its result reads in either form."""

    def __init__(self, id: str, model: str, conversation_id: str, splitter: ReasoningSplitter | None = None,
                 calls: ToolCallStream | None = None):
        """`splitter`: a reasoning template's, which streams the think block as `reasoning_content` deltas;
        `calls`: where the model may call tools, which holds back the text from where a call may begin."""
        self.id, self.model, self.conversation_id = id, model, conversation_id
        self.created = int(time.time())
        self.splitter = splitter
        self.calls = calls

    def usage(self, result: TurnResult) -> Usage:
        return Usage.model_validate({
            "prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens}})

    def info(self, result: TurnResult) -> StatekeeperInfo:
        return StatekeeperInfo.model_validate({
            "conversation_id": self.conversation_id, "ttft_ms": round(result.ttft_ms, 3),
            "restore": {"source": result.restore_source, "ms": round(result.restore_ms, 3)}})

    def whole(self, result: TurnResult) -> ChatCompletion:
        return ChatCompletion.model_validate({
            "id": self.id, "created": self.created, "model": self.model,
            "choices": [{"message": {"content": result.content if result.content or not result.tool_calls else None,
                                     "reasoning_content": result.reasoning, "tool_calls": result.tool_calls},
                         "finish_reason": result.finish_reason}],
            "usage": self.usage(result), "statekeeper": self.info(result)})

    def chunk(self, delta: ChunkDelta | None = None, finish_reason: str | None = None, **extra) -> str:
        choices = [] if delta is None else [ChunkChoice(delta=delta, finish_reason=finish_reason)]
        chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)
        return f"data: {chunk.model_dump_json()}\n\n"

    async def stream(self, first, events, include_usage: bool):
        """OpenAI's chunks: the role, the text as it comes, the finish reason (with statekeeper's extension
        field), the usage if asked for, then [DONE]. A turn that fails after the 200 went out ends the
        stream with an error event, as OpenAI's does."""
        async with contextlib.aclosing(events):  # a client gone mid-stream ends the turn now, not at GC
            yield self.chunk(ChunkDelta(role="assistant", content=""))
            async for event in after_the_200(first, events):
                if isinstance(event, Exception):
                    yield f"data: {ErrorResponse.model_validate(_stream_error(event)).model_dump_json()}\n\n"
                elif isinstance(event, TurnDelta):
                    for delta in self.deltas(event.text):
                        yield self.chunk(delta)
                else:
                    for delta in self.deltas(None, event.tool_calls):
                        yield self.chunk(delta)
                    yield self.chunk(ChunkDelta(), event.finish_reason, statekeeper=self.info(event))
                    if include_usage:
                        yield self.chunk(usage=self.usage(event))
        yield "data: [DONE]\n\n"


    def deltas(self, text: str | None, tool_calls: list[dict] | None = None) -> list[ChunkDelta]:
        """The chunks' deltas for the reply's next piece of text (None: it has ended, what was held back,
        then the turn's `tool_calls`, one delta each)."""
        if self.splitter is None:
            pieces = [("content", text)] if text is not None else []
        else:
            pieces = self.splitter.finish() if text is None else self.splitter.feed(text)
        if self.calls is not None:
            pieces = [(kind, self.calls.feed(piece) if kind == "content" else piece) for kind, piece in pieces]
            if text is None:
                pieces.append(("content", self.calls.finish(tool_calls)))
        deltas = [ChunkDelta(reasoning_content=piece) if kind == "reasoning" else ChunkDelta(content=piece)
                  for kind, piece in pieces if piece]
        if text is None and tool_calls:
            deltas += [ChunkDelta(tool_calls=[ToolCallDelta.model_validate({**call, "index": index})])
                       for index, call in enumerate(tool_calls)]
        return deltas


def _stream_error(exc: Exception) -> dict:
    if isinstance(exc, SessionError):
        return error_body(exc.status, str(exc))
    log.exception("chat completion failed mid-stream")
    return error_body(500, "the completion failed; the conversation is as it was before it")
