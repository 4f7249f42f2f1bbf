"""The OpenAI wire protocol, apart from serving it: request and response bodies with OpenAI's names and
error shape (https://platform.openai.com/docs/api-reference/chat). One schema per direction; a field
statekeeper cannot honour is refused with a 400 naming it, never silently ignored."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.schemas import RestoreSource, Text

MAX_MESSAGES = 1024
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 256  # a stop string marks an end; each generated token is checked against every one


StopText = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """A message as clients send it; `developer` is OpenAI's newer name for the system role."""

    model_config = ConfigDict(extra="ignore")  # `name` and the like change nothing here
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def as_history(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Features some clients send that this service does not have: refused by name rather than ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format", "logprobs", "top_logprobs",
               "audio", "prediction", "logit_bias")


class ChatCompletionCreate(BaseModel):
    model_config = ConfigDict(extra="allow")  # other clients' extras pass, unless named in UNSUPPORTED
    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_cache_key: str | None = None  # like X-Statekeeper-Conversation: a conversation id to try first
    user: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionCreate":
        extra = self.model_extra or {}
        refused = [name for name in UNSUPPORTED if extra.get(name) not in (None, False, [], {"type": "text"})]
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        if self.n != 1:
            raise ValueError("n must be 1")
        roles = [message.role for message in self.messages]
        if roles[-1] != "user":
            raise ValueError("the last message must be the user's")
        if any(not (isinstance(m.content, str) or m.content) for m in self.messages):
            raise ValueError("a message's content parts must not be empty")
        return self

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(stop for stop in stops if stop)

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # history tokens whose KV was restored or still active rather than prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    # A reasoning template's think block apart from the answer, as vLLM returns it; absent without one.
    reasoning_content: str | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class RestoreInfo(BaseModel):
    source: RestoreSource
    ms: float


class StatekeeperInfo(BaseModel):
    """The response's extension field: which conversation the request continued, and how its state came
    back. OpenAI clients ignore it."""

    conversation_id: str
    restore: RestoreInfo
    ttft_ms: float


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[Choice]
    usage: Usage
    statekeeper: StatekeeperInfo


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    statekeeper: StatekeeperInfo | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "statekeeper"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: what its SDKs read an error's message and code from."""

    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 409: "conflict_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 507: "server_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"),
                                           param=param, code=code)).model_dump()


# -- Responses (https://platform.openai.com/docs/api-reference/responses), the text subset -------------


class InputText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(BaseModel):
    """An input item: a message (the only item type served here)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputText]

    def as_history(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


RESPONSES_UNSUPPORTED = ("tools", "tool_choice", "text", "reasoning", "include", "background", "truncation",
                         "prompt", "conversation", "top_logprobs", "max_tool_calls")


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="allow")  # other clients' extras pass, unless named in RESPONSES_UNSUPPORTED
    model: str
    input: Text | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None  # this response's system message; not carried over, as OpenAI's
    previous_response_id: str | None = Field(None, max_length=64)
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512. Stored with the response.
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> "ResponseCreate":
        extra = self.model_extra or {}
        refused = [name for name in RESPONSES_UNSUPPORTED if extra.get(name) not in (None, False, [], {})]
        if self.stream:
            refused.append("stream (use /v1/chat/completions to stream)")
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        items = self.input_messages
        if items[-1]["role"] != "user":
            raise ValueError("the last input item must be the user's message")
        if any(item["role"] == "system" for item in items):
            raise ValueError("give the system message as `instructions`")
        return self

    @property
    def input_messages(self) -> list[dict]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return [item.as_history() for item in self.input]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["completed"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """A reasoning template's think block, before the message (as OpenAI's reasoning items for open models)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list = Field(default_factory=list)
    content: list[ReasoningText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A model response as OpenAI's Responses API returns (and stores) it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    model: str
    instructions: str | None = None
    output: list[Annotated[ReasoningItem | OutputMessage, Field(discriminator="type")]]
    previous_response_id: str | None = None
    store: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none"] = "none"
    tools: list = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage
    statekeeper: StatekeeperInfo


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
