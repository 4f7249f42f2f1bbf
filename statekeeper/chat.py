"""Chat-template rendering that only ever appends tokens.

The session's token ids are the truth the KV was computed from. A new turn renders the whole conversation,
checks that the text the existing tokens decode to is a prefix of it, and tokenizes only the new suffix, so
a re-rendered template can never silently shift tokens under the stored KV. If the prefix check fails (a
template that rewrites earlier turns), the history is re-tokenized and the caller must drop its KV."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Extension:
    tokens: list[int]
    is_append_only: bool  # False: `tokens` replaces the history and any KV computed from it


class ChatFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def extend(self, tokens: list[int], messages: list[dict]) -> Extension:
        """Token ids for `messages` plus the generation prompt, extending `tokens` where possible."""
        target = self.render(messages, add_generation_prompt=True)
        current = self.decode(tokens)
        if target.startswith(current):
            return Extension(tokens + self.encode(target[len(current) :]), True)
        return Extension(self.encode(target), False)
