"""Tool calls in a model's reply: each chat-template family writes them its own way, and OpenAI's API returns
them as `tool_calls`. One small class per format, chosen from the chat template (or the TOOL_CALL_FORMAT
setting):
- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen 2.5/3);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- llama3_json: the whole reply is `{"name": ..., "parameters": {...}}` (Llama 3.1+), after an optional
  `<|python_tag|>`, several calls separated by `;`.
A reply whose calls do not parse (bad JSON, no name, arguments that are not an object) is returned as text,
whole, and so is one that is not a call the API can return (a name OpenAI's rule refuses or that no offered tool
has, keys a call does not have): a model's malformed call is the client's to see, never a server error."""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Collection
from dataclasses import dataclass

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for a function's name (api/openai/protocol.py)
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id"})
# A JSON text nested deeper than the parser's recursion limit raises RecursionError, not ValueError
_NOT_JSON = (ValueError, RecursionError)


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str  # the text before the first call ("" when there is none or only blank space)
    tool_calls: list[dict] | None  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}


def openai_call_id() -> str:
    return f"call_{secrets.token_urlsafe(12)}"


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates refuse any other id when the history is rendered."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def _call_of(value, names: Collection[str] | None, new_id: Callable[[], str]) -> dict | None:
    """One call in OpenAI's shape, with a fresh id and its arguments as the JSON text OpenAI sends; None where
    `value` is not a call the API can return (`names`: the offered tools', where known)."""
    if not isinstance(value, dict) or not value.keys() <= _CALL_KEYS:
        return None  # e.g. a plain JSON answer that has a "name" among its fields
    name = value.get("name")
    if not isinstance(name, str) or not re.fullmatch(TOOL_NAME_PATTERN, name) or (names is not None and name not in names):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    try:
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate ("\\ud800") has no UTF-8 form: no response could carry it
    except (*_NOT_JSON, UnicodeEncodeError):
        return None
    return {"id": new_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _blank_to_empty(text: str) -> str:
    return text if text.strip() else ""


@dataclass(frozen=True, slots=True)
class HermesFormat:
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse(self, text: str, names: Collection[str] | None = None) -> ParsedReply:
        """`names`: the offered tools' (None: any name OpenAI's rule takes)."""
        first = text.find(self.start)
        if first < 0:
            return ParsedReply(text, None)
        calls, rest = [], text[first:]
        while rest.strip():
            if not rest.lstrip().startswith(self.start):
                return ParsedReply(text, None)  # text after a call: not a reply made of calls
            rest = rest.lstrip()[len(self.start):]
            closed = rest.find(self.end)
            body, rest = (rest, "") if closed < 0 else (rest[:closed], rest[closed + len(self.end):])
            try:
                call = _call_of(json.loads(body), names, openai_call_id)
            except _NOT_JSON:
                call = None
            if call is None:
                return ParsedReply(text, None)
            calls.append(call)
        return ParsedReply(_blank_to_empty(text[:first]), calls)


@dataclass(frozen=True, slots=True)
class MistralFormat:
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text: str, names: Collection[str] | None = None) -> ParsedReply:
        first = text.find(self.start)
        if first < 0:
            return ParsedReply(text, None)
        try:
            values = json.loads(text[first + len(self.start):])
        except _NOT_JSON:
            return ParsedReply(text, None)
        calls = [_call_of(value, names, mistral_call_id) for value in (values if isinstance(values, list) else [values])]
        if not calls or None in calls:
            return ParsedReply(text, None)
        return ParsedReply(_blank_to_empty(text[:first]), calls)


@dataclass(frozen=True, slots=True)
class Llama3JsonFormat:
    name = "llama3_json"
    start = "<|python_tag|>"

    def parse(self, text: str, names: Collection[str] | None = None) -> ParsedReply:
        body = text.strip()
        body = body[len(self.start):] if body.startswith(self.start) else body
        if not body.startswith("{"):
            return ParsedReply(text, None)
        decoder, calls, position = json.JSONDecoder(), [], 0
        try:
            while position < len(body):
                value, position = decoder.raw_decode(body, position)
                calls.append(_call_of(value, names, openai_call_id))
                position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
        except _NOT_JSON:
            return ParsedReply(text, None)
        if None in calls:
            return ParsedReply(text, None)
        return ParsedReply("", calls)

    def may_start(self, text: str) -> bool:
        """Whether a reply that begins with `text` may be a call: it is one from its first character."""
        body = text.lstrip()
        return body.startswith(("{", self.start)) or (self.start.startswith(body))


ToolCallFormat = HermesFormat | MistralFormat | Llama3JsonFormat
FORMATS = {format_.name: format_ for format_ in (HermesFormat(), MistralFormat(), Llama3JsonFormat())}


def format_for(template: str | None, setting: str = "auto") -> ToolCallFormat | None:
    """The format a template's model writes its calls in: the setting's, or the one whose markers the
    template holds ("auto"); None for a template without tools, or "none"."""
    if setting != "auto":
        return FORMATS.get(setting)
    template = template or ""
    if "tools" not in template:
        return None
    if HermesFormat.start in template:
        return FORMATS["hermes"]
    if MistralFormat.start in template:
        return FORMATS["mistral"]
    if Llama3JsonFormat.start in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]  # the most common format among open models' templates with tools


class ToolCallStream:
    """A streamed reply's text as content deltas, held back from where a call may begin: what comes before
    the first call streams as it comes; from the call's marker on (or a part of the marker at the end, or
    a llama3_json reply's first character) it is held, and once the turn has ended it is either calls
    (the turn's own, with the ids the history keeps) or, when they did not parse, content."""

    def __init__(self, format_: ToolCallFormat):
        self.format = format_
        self._text = ""
        self._sent = 0  # characters of _text already streamed as content
        self.holding = False  # a call may have begun: nothing more streams until the turn ends

    def feed(self, text: str) -> str:
        """The content that can stream now, given the reply's next piece."""
        self._text += text
        if self.holding:
            return ""
        if isinstance(self.format, Llama3JsonFormat) and self._sent == 0:
            if self.format.may_start(self._text):
                self.holding = self._text.strip() != "" and not self.format.start.startswith(self._text.lstrip())
                return ""
        marker = self._text.find(self.format.start, self._sent)
        if marker >= 0:
            self.holding = True
            # Blank space before a call is no content (ParsedReply drops it); it streams only if no call parses.
            return self._take(marker) if self._text[self._sent:marker].strip() or self._sent else ""
        end = len(self._text) - partial_marker_length(self._text, self.format.start)
        if not self._text[:end].strip():
            return ""  # blank space before a call is not content: held until text comes
        return self._take(end)

    def finish(self, tool_calls: list[dict] | None) -> str:
        """What was held back as content: nothing where the turn's reply was calls."""
        if tool_calls:
            return ""
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        piece, self._sent = self._text[self._sent:end], max(self._sent, end)
        return piece


def partial_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker` (what a stream holds back until the
    next piece tells: a tool call's marker here, a think block's closing tag in statekeeper/chat.py)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
