"""The OpenAI wire protocol, apart from serving it: request and response bodies with OpenAI's names and
error shape (https://platform.openai.com/docs/api-reference/chat). One schema per direction; a field
statekeeper cannot honour is refused with a 400 naming it, never silently ignored."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator,
                      model_validator)

from api.schemas import RestoreSource, Text, json_problem
from statekeeper.placement.retention import OPENAI_RETENTION
from statekeeper.tool_calls import TOOL_NAME_PATTERN

MAX_MESSAGES = 1024
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 256  # a stop string marks an end; each generated token is checked against every one


StopText = Annotated[Text, Field(max_length=MAX_STOP_CHARS)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


MAX_TOOLS = 128  # as OpenAI
MAX_TOOL_SCHEMA_DEPTH = 32
ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]
ToolCallId = Annotated[str, Field(min_length=1, max_length=64)]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    arguments: Text  # JSON text, as the model wrote it (OpenAI's shape)


class ToolCall(BaseModel):
    """A call the model made, as a reply returns it and a client resends it."""

    model_config = ConfigDict(extra="ignore")
    id: ToolCallId
    type: Literal["function"] = "function"
    function: FunctionCall


def _text(content) -> str:
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


class TextMessage(BaseModel):
    """A system or user message; `developer` is OpenAI's newer name for the system role."""

    model_config = ConfigDict(extra="ignore")  # `name` and the like change nothing here
    role: Literal["system", "developer", "user"]
    content: Text | list[TextPart]

    def as_history(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role, "content": _text(self.content)}


class AssistantMessageIn(BaseModel):
    """An earlier reply, resent: text, calls, or both."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["assistant"]
    content: Text | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None

    @model_validator(mode="after")
    def _says_something(self) -> "AssistantMessageIn":
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def as_history(self) -> dict:
        """Role and text, and only where present its calls (plain replies compare and index as before)."""
        calls = {"tool_calls": [call.model_dump() for call in self.tool_calls]} if self.tool_calls else {}
        return {"role": "assistant", "content": _text(self.content)} | calls


class ToolMessage(BaseModel):
    """A call's result, naming the call it answers."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["tool"]
    content: Text | list[TextPart]
    tool_call_id: ToolCallId

    def as_history(self) -> dict:
        return {"role": "tool", "content": _text(self.content), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[TextMessage | AssistantMessageIn | ToolMessage, Field(discriminator="role")]


def _shallow_schema(parameters: dict | None) -> dict | None:
    if parameters is not None and (problem := json_problem(parameters, MAX_TOOL_SCHEMA_DEPTH)) is not None:
        raise ValueError(f"parameters {problem}")
    return parameters


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    description: Text | None = None
    parameters: Annotated[dict | None, AfterValidator(_shallow_schema)] = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """A function the model may call, rendered into the prompt by the model's own chat template."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


# Features some clients send that this service does not have: refused by name rather than ignored.
UNSUPPORTED = ("functions", "function_call", "response_format", "logprobs", "top_logprobs", "audio", "prediction",
               "logit_bias")


# The chat template's own variables a request may set (vLLM's and SGLang's `chat_template_kwargs`, such as
# Qwen3's enable_thinking): named like Jinja variables, scalar values, and never what the service renders with.
TemplateOptionName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateOptionValue = bool | int | Annotated[float, Field(allow_inf_nan=False)] | Annotated[Text, Field(max_length=256)]
RENDERING_NAMES = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "tokenize",
                   "chat_template", "return_dict", "return_tensors", "tokenizer_kwargs", "padding", "truncation",
                   "max_length", "return_assistant_tokens_mask")


# OpenAI's extended prompt caching: "24h" keeps the conversation's stored state up to a day at high priority
# (statekeeper/placement/retention.py OPENAI_RETENTION), "in_memory" returns it to its tenant's retention.
PromptCacheRetention = Literal["in_memory", "24h"]


def retention_of(setting: PromptCacheRetention | None) -> dict | None:
    """The conversation retention a request's `prompt_cache_retention` asks for (None: unchanged)."""
    return None if setting is None else dict(OPENAI_RETENTION[setting])


def null_is_default(cls, value, info: ValidationInfo):
    """OpenAI's schema lets these be null, meaning the default (clients send explicit nulls)."""
    return cls.model_fields[info.field_name].default if value is None else value


class ChatCompletionCreate(BaseModel):
    model_config = ConfigDict(extra="allow")  # other clients' extras pass, unless named in UNSUPPORTED
    model: Text
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
    prompt_cache_retention: PromptCacheRetention | None = None
    user: str | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    # "auto": the model may call a tool; "none": it may not (its calls come back as text). Forcing a call
    # ("required", a named function) needs constrained decoding, which this server does not have.
    tool_choice: Literal["none", "auto"] | dict | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Annotated[dict[TemplateOptionName, TemplateOptionValue], Field(max_length=16)] | None = None

    _null_is_default = field_validator("temperature", "top_p", "n", "stream", "parallel_tool_calls",
                                       mode="before")(null_is_default)

    @model_validator(mode="after")
    def _supported(self) -> "ChatCompletionCreate":
        extra = self.model_extra or {}
        refused = [name for name in UNSUPPORTED if extra.get(name) not in (None, False, [], {}, {"type": "text"})]
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RENDERING_NAMES))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the service renders with them")
        if isinstance(self.tool_choice, dict):
            refused.append("tool_choice naming a function (use \"auto\" or \"none\")")
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        if self.n != 1:
            raise ValueError("n must be 1")
        roles = [message.role for message in self.messages]
        if roles[-1] not in ("user", "tool"):
            raise ValueError("the last message must be the user's or a tool result")
        if any(isinstance(m.content, list) and not m.content for m in self.messages):
            raise ValueError("a message's content parts must not be empty")
        return self

    @property
    def stop_sequences(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(stop for stop in stops if stop)

    @property
    def reply_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def tool_definitions(self) -> list[dict] | None:
        """The tools as the chat template takes them (None: no tools)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # history tokens whose KV was restored or still active rather than prefilled


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # a reasoning template's think block, which the next prompt drops


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: a reply made of tool calls only
    tool_calls: list[ToolCall] | None = None
    # A reasoning template's think block apart from the answer, as vLLM returns it; absent without one.
    reasoning_content: str | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
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


class ToolCallDelta(ToolCall):
    """A streamed call: OpenAI's chunks number each call (`index`); this server sends each one whole."""

    index: int


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
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
    """An input item: a message."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[InputText]

    def as_history(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class FunctionCallItem(BaseModel):
    """An input item: a call the model made (a response's output item, resent)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: ToolCallId
    name: ToolName
    arguments: Text

    def as_call(self) -> dict:
        return {"id": self.call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(BaseModel):
    """An input item: a call's result, for the model to read."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: ToolCallId
    output: Text


class ReasoningInputItem(BaseModel):
    """An input item: a reasoning item of an earlier response, resent (`input += response.output`). Taken and
    left out of the history: reasoning templates drop earlier turns' think blocks, and the history keeps the
    answer as chat clients resend it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["reasoning"]


def _item_type(item) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningInputItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(BaseModel):
    """A function tool as the Responses API names it (flat, where chat completions nest it in `function`)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: Annotated[dict | None, AfterValidator(_shallow_schema)] = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude_none=True, exclude={"type"})}


# The ids this server gives stored responses ("resp_" and token_urlsafe(24)); another is none of them, and is
# never looked up (an empty key is an error to LMDB, a NUL one to PostgreSQL)
RESPONSE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

RESPONSES_UNSUPPORTED = ("text", "reasoning", "include", "background", "truncation", "prompt", "conversation",
                         "top_logprobs", "max_tool_calls")


class ResponseCreate(BaseModel):
    model_config = ConfigDict(extra="allow")  # other clients' extras pass, unless named in RESPONSES_UNSUPPORTED
    model: Text
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None  # this response's system message; not carried over, as OpenAI's
    previous_response_id: str | None = Field(None, pattern=RESPONSE_ID_PATTERN)
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
    prompt_cache_retention: PromptCacheRetention | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto"] | dict | None = None  # as on chat completions
    parallel_tool_calls: bool = True

    _null_is_default = field_validator("temperature", "top_p", "store", "stream", "parallel_tool_calls",
                                       mode="before")(null_is_default)

    @model_validator(mode="after")
    def _supported(self) -> "ResponseCreate":
        extra = self.model_extra or {}
        refused = [name for name in RESPONSES_UNSUPPORTED if extra.get(name) not in (None, False, [], {})]
        if isinstance(self.tool_choice, dict):
            refused.append("tool_choice naming a function (use \"auto\" or \"none\")")
        if self.stream:
            refused.append("stream (use /v1/chat/completions to stream)")
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        items = self.input_messages
        if not items or items[-1]["role"] not in ("user", "tool"):
            raise ValueError("the last input item must be the user's message or a function_call_output")
        if any(item["role"] == "system" for item in items):
            raise ValueError("give the system message as `instructions`")
        return self

    @property
    def input_messages(self) -> list[dict]:
        """The input as history messages: a function_call joins the assistant message before it (as the
        history keeps a reply that is text and calls), a function_call_output is a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                if not (messages and messages[-1]["role"] == "assistant"):
                    messages.append({"role": "assistant", "content": ""})
                messages[-1]["tool_calls"] = [*messages[-1].get("tool_calls", ()), item.as_call()]
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "content": item.output, "tool_call_id": item.call_id})
            elif isinstance(item, ReasoningInputItem):
                continue
            else:
                messages.append(item.as_history())
        return messages

    @property
    def tool_definitions(self) -> list[dict] | None:
        return [tool.as_chat_tool() for tool in self.tools] if self.tools else None

    @property
    def calls_allowed(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


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


class FunctionCallOutput(BaseModel):
    """An output item: a call the model made; the client answers it with a function_call_output item."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"] = "completed"


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
    output: list[Annotated[ReasoningItem | OutputMessage | FunctionCallOutput, Field(discriminator="type")]]
    previous_response_id: str | None = None
    store: bool
    temperature: float
    top_p: float
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = False
    tool_choice: Literal["none", "auto"] = "none"
    tools: list[FunctionTool] = Field(default_factory=list)
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage
    statekeeper: StatekeeperInfo


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True
