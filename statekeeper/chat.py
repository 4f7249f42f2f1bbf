"""Chat-template rendering that only ever appends tokens.

The session's token ids are the truth the KV was computed from. A new turn renders the whole conversation,
checks that the text the existing tokens decode to is a prefix of it, and tokenizes only the new suffix, so
a re-rendered template can never silently shift tokens under the stored KV. If the prefix check fails (a
template that rewrites earlier turns: one that moves the system prompt, drops think blocks, dates the
prompt), the history is re-tokenized, and the caller keeps only the KV of the tokens the two share from the
start (`common`), as a prefix cache would."""

from __future__ import annotations

import datetime
import functools
import json
import re
from dataclasses import dataclass

import jinja2

from statekeeper.tool_calls import ToolCallFormat, format_for, partial_marker_length


@dataclass(slots=True)
class Extension:
    tokens: list[int]
    is_append_only: bool  # False: `tokens` replaces the history; KV computed from it holds only up to `common`
    common: int  # leading tokens of the history that `tokens` keeps (all of them when append-only)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_NEXT_TURN = "statekeeper-next-user-message"  # stands for the next turn's text while it is unknown
_REPLY = "statekeeper-reply"  # stands for a reply still being generated
PROBED_TOKENS = 32  # the end of a long text the probes encode again (ChatFormatter._settled)
# What a user message may start with, for what the tokens before it merge with (ChatFormatter._stable_tokens).
_FOLLOWERS = ("\n", "\n\n", " ", "  ", "\t", "a", "A", "Hello", " Hello", "1", " 1", ".", ",", "'", '"', "-", "(",
              "[", "<", "*", "#", "é", "É", "你", "\U0001F600")
# transformers' `strftime_now(format)`, with a literal format: what a template that writes today's date calls
_STRFTIME_CALL = re.compile(r"""strftime_now\s*\(\s*(?:'([^'\\]*)'|"([^"\\]*)")\s*\)""")
_DATES = "statekeeper_dates"  # the rewritten template's table of the dates it renders, by format


class TemplateRefused(ValueError):
    """The chat template refused the messages, tools or options it was given (a request's fault: its
    `raise_exception`, or a `chat_template_kwargs` value of a type it cannot use)."""


def _for_template(message: dict) -> dict:
    """A message as chat templates take it: a call's arguments as an object (templates write them with
    `tojson`), where the history keeps OpenAI's JSON text."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except (TypeError, ValueError, RecursionError):  # RecursionError: JSON nested past the parser's limit
            pass  # text that is not JSON is rendered as the text it is
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _dated_template(template: str | None, day: datetime.date) -> tuple[str, dict]:
    """`template` rewritten to render `day` where it calls `strftime_now`, and the variables it then reads.
    Template variables reach the template as plain data only (transformers' sandbox), so each literal format
    the template asks for is formatted here and each call becomes a lookup. ValueError where the template has
    no such call, calls it otherwise (a format not a literal), or asks for a time of day, which only the
    moment of rendering knows."""
    if not template or "strftime_now" not in template:
        raise ValueError("the template does not write today's date")
    formats = {single or double for single, double in _STRFTIME_CALL.findall(template)}
    start, end = datetime.datetime.combine(day, datetime.time.min), datetime.datetime.combine(day, datetime.time.max)
    if any(start.strftime(fmt) != end.strftime(fmt) for fmt in formats):
        raise ValueError("the template writes the time of day")
    rewritten = _STRFTIME_CALL.sub(lambda match: f"{_DATES}[{json.dumps(match.group(1) or match.group(2))}]",
                                   template)
    if re.search(r"strftime_now\s*\(", rewritten):
        raise ValueError("the template calls strftime_now with a format that is not a literal")
    rewritten = rewritten.replace("strftime_now", _DATES)  # `strftime_now is defined` and the like
    return rewritten, {_DATES: {fmt: day.strftime(fmt) for fmt in formats}}


class ChatFormatter:
    def __init__(self, tokenizer, tool_call_format: str = "auto", day: datetime.date | None = None):
        """`tool_call_format`: how the model writes tool calls (statekeeper/tool_calls.py); "auto" reads it
        from the chat template. `day`: rendered where the template writes today's date (on_date)."""
        self.tokenizer = tokenizer
        self._tool_call_format = tool_call_format
        self._dated: tuple[str, dict] | None = None if day is None else _dated_template(tokenizer.chat_template, day)

    def on_date(self, day: datetime.date) -> ChatFormatter | None:
        """A formatter that renders `day` where this one's template writes today's date, as it will render once
        the service's date is `day` (sessions/date_rollover.py prepares the turns after a midnight before it);
        None where the template reads the date otherwise than `strftime_now` with a literal format."""
        try:
            return ChatFormatter(self.tokenizer, self._tool_call_format, day)
        except ValueError:
            return None

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
               options: dict | None = None) -> str:
        """`options`: the template's own variables (OpenAI-compatible servers' `chat_template_kwargs`, such
        as Qwen3's `enable_thinking`)."""
        template, dates = self._dated or (None, {})
        try:
            return self.tokenizer.apply_chat_template(
                [_for_template(message) for message in messages], tools=tools or None, tokenize=False,
                add_generation_prompt=add_generation_prompt, chat_template=template, **dates, **(options or {})
            )
        except (jinja2.TemplateError, TypeError) as exc:  # raise_exception, or options of a type it cannot use
            raise TemplateRefused(f"the chat template cannot render this request: {exc}") from None

    @property
    def tool_call_format(self) -> ToolCallFormat | None:
        """The format the model writes tool calls in; None where the chat template has no tools."""
        return format_for(self.tokenizer.chat_template, self._tool_call_format)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its piece's length (a byte-level BPE piece spells each
        of its bytes as one character, and a text has no more characters than bytes)."""
        return max(1, max(len(piece) for piece in self.tokenizer.get_vocab()))

    def min_tokens(self, texts) -> int:
        """Fewer tokens than this cannot spell `texts`: a bound known without tokenizing them."""
        return sum(len(text) for text in texts) // self.max_token_chars

    @functools.cached_property
    def renders_today(self) -> bool:
        """Whether the template may write today's date (Llama 3.x's "Today Date": transformers' `strftime_now`,
        the service's local time, TZ): then its renderings change at midnight, the system turn first."""
        return "strftime_now" in (self.tokenizer.chat_template or "")

    @functools.cached_property
    def moves_earlier_turns(self) -> bool:
        """Whether the template renders a turn's prompt otherwise once a reply follows it, before that reply (it
        moves the system prompt before the last user message, as Mistral-family templates do): probed once, with
        and without a system message. Only then is the next turn's head worth preparing while the reply is
        generated (NextTurnState.start_early): every other template renders nothing for it."""
        user = {"role": "user", "content": "statekeeper-probe"}
        probes = ([user], [{"role": "system", "content": "statekeeper-system"}, user])
        return any(self.reply_head(messages) is not None for messages in probes)

    @functools.cached_property
    def rewrites_history(self) -> bool:
        """Whether the template may render an earlier turn otherwise once the conversation goes on (it drops a
        think block, moves the system prompt, writes today's date, renders tool calls its own way): probed once,
        with and without a system prompt. Only then does a turn's
        end render the next turn (next_turn): for the others that rendering of the whole history, on a thread
        beside the model thread's, found nothing to prepare at every turn. A template that knows think blocks
        always does: the history keeps a reply's answer alone, the tokens its whole text."""
        if self.renders_today or self.moves_earlier_turns or self.tool_call_format is not None or self.uses_thinking:
            return True
        user, later = {"role": "user", "content": "statekeeper-probe"}, {"role": "user", "content": "statekeeper-next"}
        reply = {"role": "assistant", "content": "statekeeper-reply"}
        for system in ([], [{"role": "system", "content": "statekeeper-system"}]):
            try:
                prompt = self.render(system + [user], add_generation_prompt=True)
                then = self.render(system + [user, reply, later], add_generation_prompt=True)
            except Exception:  # a template that refuses a probe: it may render anything
                return True
            if not then.startswith(prompt + reply["content"]):
                return True
        return False

    @functools.cached_property
    def uses_thinking(self) -> bool:
        """Whether the template knows think blocks (a reasoning model's: Qwen3, QwQ, DeepSeek-R1 distills)."""
        return THINK_CLOSE in (self.tokenizer.chat_template or "")

    def opens_thinking(self, options: dict | None = None) -> bool:
        """Whether the template's generation prompt (with these `options`) leaves a think block open, so a
        reply begins in reasoning (thinking on); an empty closed block (thinking off) or none: it begins with
        the answer."""
        if not self.uses_thinking:
            return False
        return self._opens_thinking(tuple(sorted((options or {}).items())))

    @functools.lru_cache(maxsize=64)  # noqa: B019 - one formatter per service, a few option sets
    def _opens_thinking(self, options: tuple) -> bool:
        marker = "statekeeper-probe"
        prompt = self.render([{"role": "user", "content": marker}], add_generation_prompt=True, options=dict(options))
        tail = prompt[prompt.rfind(marker) + len(marker):]
        return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)

    def split_reasoning(self, text: str, options: dict | None = None) -> Reply:
        """A reply's reasoning apart from its answer, where the template has think blocks: the text up to the
        block's closing tag (after the model's own opening tag, or the one the generation prompt opened), and
        the answer after it, its leading newlines dropped; a reply that ended before closing its block is all
        reasoning. Without think blocks in the template, all answer."""
        if not self.uses_thinking:
            return Reply(None, text)
        splitter = ReasoningSplitter(self.opens_thinking(options))
        pieces = splitter.feed(text) + splitter.finish()
        reasoning = "".join(piece for kind, piece in pieces if kind == "reasoning")
        return Reply(reasoning, "".join(piece for kind, piece in pieces if kind == "content"))

    def reasoning_tokens(self, tokens: list[int], reply: Reply) -> int:
        """How many of a reply's `tokens` are its reasoning (`reply` is their split_reasoning): those up to
        the one that completes the block's closing tag; all of them for a block the reply never closed.
        (OpenAI's usage reports them; the next rendering of a think-dropping template keeps none.)"""
        if not reply.reasoning:
            return 0
        if THINK_CLOSE not in self.decode(tokens):
            return len(tokens)
        low, high = 1, len(tokens)  # the shortest prefix whose text holds the closing tag
        while low < high:
            middle = (low + high) // 2
            if THINK_CLOSE in self.decode(tokens[:middle]):
                high = middle
            else:
                low = middle + 1
        return low

    def reasoning_splitter(self, options: dict | None = None) -> ReasoningSplitter | None:
        """A streamed reply's splitter, where the template has think blocks."""
        return ReasoningSplitter(self.opens_thinking(options)) if self.uses_thinking else None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def extend(self, tokens: list[int], messages: list[dict], tools: list[dict] | None = None,
               options: dict | None = None) -> Extension:
        """Token ids for `messages` (and `tools`, the template's `options`) plus the generation prompt,
        extending `tokens` where possible."""
        target = self.render(messages, add_generation_prompt=True, tools=tools, options=options)
        current = self.decode(tokens)
        if target.startswith(current):
            return Extension(tokens + self.encode(target[len(current) :]), True, len(tokens))
        rendered = self.encode(target)
        common = common_prefix_length(tokens, rendered)
        return Extension(rendered, False, common)

    def next_turn(self, tokens: list[int], messages: list[dict], tools: list[dict] | None = None,
                  options: dict | None = None) -> Extension | None:
        """What the next turn will render of this history, where the template renders it otherwise than
        `tokens` (it dropped a think block, moved the system prompt): the tokens of its rendering before the
        next user message's text, as far as what follows cannot change them, with how many of `tokens` they
        keep from the start. None where the next turn only appends to `tokens`, or where the template cannot
        render a next turn here."""
        if not self.rewrites_history:
            return None
        try:
            text = self.render(messages + [{"role": "user", "content": _NEXT_TURN}], add_generation_prompt=True,
                               tools=tools, options=options)
        except Exception:  # a template that refuses this history followed by a user message
            return None
        if _NEXT_TURN not in text:
            return None
        before = text[: text.rindex(_NEXT_TURN)]
        if before.startswith(self.decode(tokens)):
            return None
        rendered = self._stable_tokens(before)
        if not rendered:
            return None
        common = common_prefix_length(tokens, rendered)
        return Extension(rendered, False, common)

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        added = self.tokenizer.added_tokens_decoder.items()
        return frozenset(self.tokenizer.all_special_ids) | {token_id for token_id, token in added if token.special}

    def _stable_tokens(self, text: str) -> list[int]:
        """The tokens of `text` that stay its tokens whatever text follows: the next turn's text is encoded with
        the rest, as a fresh rendering encodes it. Ended after "user\n", SmolLM2's tokenizer merged that "\n"
        with a message's leading "\n\n". A tokenizer splits text at special tokens, so only the tokens after the
        last one can change: those kept are the ones no probe of what may follow (newlines, spaces, words,
        punctuation, other scripts) changes, so a template that writes the system prompt after the last special
        token (Mistral's, inside the last [INST]) keeps it."""
        tokens = self.encode(text)
        special = self._special_ids
        last = next((at for at in range(len(tokens) - 1, -1, -1) if tokens[at] in special), -1)
        head, tail = tokens[: last + 1], tokens[last + 1 :]
        spelled = self.decode(head)
        if not text.startswith(spelled):  # a tokenizer whose decoding does not give the text back
            return head
        rest = text[len(spelled) :]
        fixed, tail, rest = self._settled(tail, rest)
        keep = len(tail)
        for probe in _FOLLOWERS:
            keep = min(keep, common_prefix_length(tail, self.encode(rest + probe)))
        return head + fixed + tail[:keep]

    def _settled(self, tail: list[int], rest: str) -> tuple[list[int], list[int], str]:
        """`tail` (the tokens of the text `rest`) split where the last PROBED_TOKENS begin, if their text
        encodes alone to those tokens: the probes encode that end only (a system prompt of thousands of tokens
        after the last special token cost each probe the whole of it). Else nothing is split off."""
        if len(tail) <= 2 * PROBED_TOKENS:
            return [], tail, rest
        fixed = tail[: -PROBED_TOKENS]
        spelled = self.decode(fixed)
        end = rest[len(spelled) :]
        if not rest.startswith(spelled) or self.encode(end) != tail[-PROBED_TOKENS:]:
            return [], tail, rest
        return fixed, tail[-PROBED_TOKENS:], end

    def reply_head(self, messages: list[dict], tools: list[dict] | None = None, options: dict | None = None,
                   prompt_ids: list[int] | None = None) -> Extension | None:
        """What the turn after the one answering `messages` (which end with its user message) will render of
        them, up to that answer's text (known while the answer is generated), with how many tokens it shares
        with this turn's prompt (`prompt_ids`, the ids the turn runs on, which need not be its text's tokenization:
        earlier replies keep the tokens the model sampled; else the text encoded); None where it extends the
        prompt (nothing to prepare) or the template cannot render it here."""
        try:
            then = [{"role": "assistant", "content": _REPLY}, {"role": "user", "content": _NEXT_TURN}]
            text = self.render(messages + then, add_generation_prompt=True, tools=tools, options=options)
            prompt = self.render(messages, add_generation_prompt=True, tools=tools, options=options)
        except Exception:  # a template that refuses this history
            return None
        if _REPLY not in text:
            return None
        head = text[: text.index(_REPLY)]
        if head.startswith(prompt) or prompt.startswith(head):
            return None
        tokens = self.encode(head)
        ids = self.encode(prompt) if prompt_ids is None else prompt_ids
        return Extension(tokens, False, common_prefix_length(ids, tokens))

    def append_turns(self, tokens: list[int], history: list[dict], messages: list[dict], end_of_turn: int,
                     tools: list[dict] | None = None, options: dict | None = None):
        """Extends `tokens` with `messages` exactly as real turns would: each user message through the
        chat template (with the conversation's `tools` and template `options`, as its turns render), each
        assistant reply as its tokens plus `end_of_turn`, as if generated. Returns the new token list and the
        [start, end) spans of the assistant tokens."""
        roles = [m["role"] for m in messages]
        if not messages or roles[-1] != "assistant" or any(r not in ("user", "assistant") for r in roles):
            raise ValueError("messages must be user/assistant turns ending with an assistant reply")
        if roles[0] != "user" or any(a == b for a, b in zip(roles, roles[1:])):
            raise ValueError("messages must alternate, starting with a user message")
        spans = []
        context = list(history)
        for message in messages:
            if message["role"] == "assistant":
                extension = self.extend(tokens, context, tools, options)
                if not extension.is_append_only:
                    raise ValueError("the chat template rewrites earlier turns")
                start = len(extension.tokens)
                tokens = extension.tokens + self.encode(message["content"]) + [end_of_turn]
                spans.append((start, len(tokens)))
            context = context + [message]
        return tokens, spans


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class Reply:
    """A reply as a reasoning template's model writes it: its reasoning (None: the template has no think
    blocks) and the answer after it, which is what the conversation keeps and the client resends."""

    reasoning: str | None
    content: str


class ReasoningSplitter:
    """Splits a reply streamed in pieces into reasoning and answer as they come, the same as
    ChatFormatter.split_reasoning splits the whole: it holds back only what could still be the start of the
    closing tag."""

    def __init__(self, in_reasoning: bool):
        self.in_reasoning = in_reasoning
        self._held = ""
        self._answer_started = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        """(kind, text) pieces, kind "reasoning" or "content", for the reply's next piece."""
        self._held += text
        out = []
        if not self.in_reasoning and not self._answer_started:
            stripped = self._held.lstrip()
            if THINK_OPEN.startswith(stripped) and len(stripped) < len(THINK_OPEN):
                return out  # maybe a think block the model opens itself: wait for more
            if stripped.startswith(THINK_OPEN):
                self.in_reasoning, self._held = True, stripped[len(THINK_OPEN):]
        if self.in_reasoning:
            closed = self._held.find(THINK_CLOSE)
            if closed < 0:
                keep = partial_marker_length(self._held, THINK_CLOSE)
                piece, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep:]
                if piece:
                    out.append(("reasoning", piece))
                return out
            if self._held[:closed]:
                out.append(("reasoning", self._held[:closed]))
            self.in_reasoning, self._held = False, self._held[closed + len(THINK_CLOSE):]
        if not self._answer_started:
            self._held = self._held.lstrip("\n")
            if not self._held:
                return out
            self._answer_started = True
        out.append(("content", self._held))
        self._held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, once the reply has ended."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self.in_reasoning else "content", held)]


