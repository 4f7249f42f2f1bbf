"""Chat template fixtures (issue 30), used by the tests and by benchmarks/chat_shapes.py: think (Qwen3's way:
the history drops think blocks, the generation prompt opens one, or closes an empty one with enable_thinking
false), think-off (the same with thinking always off), system-last (the system prompt moved before the last
user message), dated (Llama 3's: the date in the system turn, `date_string` or today's), tools-hermes (tools
in the system turn, calls as <tool_call>{json}</tool_call>)."""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent


def template_text(name: str) -> str:
    return (FOLDER / f"{name}.jinja").read_text()
