"""Chat-template rendering that only ever appends tokens.

The session's token ids are the truth the KV was computed from. A new turn renders the whole conversation,
checks that the text the existing tokens decode to is a prefix of it, and tokenizes only the new suffix, so
a re-rendered template can never silently shift tokens under the stored KV. If the prefix check fails (a
template that rewrites earlier turns: one that moves the system prompt, drops think blocks, dates the
prompt), the history is re-tokenized, and the caller keeps only the KV of the tokens the two share from the
start (`common`), as a prefix cache would."""

from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(slots=True)
class Extension:
    tokens: list[int]
    is_append_only: bool  # False: `tokens` replaces the history; KV computed from it holds only up to `common`
    common: int  # leading tokens of the history that `tokens` keeps (all of them when append-only)


class ChatFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: its piece's length (a byte-level BPE piece spells each
        of its bytes as one character, and a text has no more characters than bytes)."""
        return max(1, max(len(piece) for piece in self.tokenizer.get_vocab()))

    def min_tokens(self, texts) -> int:
        """Fewer tokens than this cannot spell `texts`: a bound known without tokenizing them."""
        return sum(len(text) for text in texts) // self.max_token_chars

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def extend(self, tokens: list[int], messages: list[dict]) -> Extension:
        """Token ids for `messages` plus the generation prompt, extending `tokens` where possible."""
        target = self.render(messages, add_generation_prompt=True)
        current = self.decode(tokens)
        if target.startswith(current):
            return Extension(tokens + self.encode(target[len(current) :]), True, len(tokens))
        rendered = self.encode(target)
        common = next((i for i, (a, b) in enumerate(zip(tokens, rendered)) if a != b), min(len(tokens), len(rendered)))
        return Extension(rendered, False, common)

    def append_turns(self, tokens: list[int], history: list[dict], messages: list[dict], end_of_turn: int):
        """Extends `tokens` with `messages` exactly as real turns would: each user message through the
        chat template, each assistant reply as its tokens plus `end_of_turn`, as if generated. Returns the
        new token list and the [start, end) spans of the assistant tokens."""
        roles = [m["role"] for m in messages]
        if not messages or roles[-1] != "assistant" or any(r not in ("user", "assistant") for r in roles):
            raise ValueError("messages must be user/assistant turns ending with an assistant reply")
        if roles[0] != "user" or any(a == b for a, b in zip(roles, roles[1:])):
            raise ValueError("messages must alternate, starting with a user message")
        spans = []
        context = list(history)
        for message in messages:
            if message["role"] == "assistant":
                extension = self.extend(tokens, context)
                if not extension.is_append_only:
                    raise ValueError("the chat template rewrites earlier turns")
                start = len(extension.tokens)
                tokens = extension.tokens + self.encode(message["content"]) + [end_of_turn]
                spans.append((start, len(tokens)))
            context = context + [message]
        return tokens, spans
