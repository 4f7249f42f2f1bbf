"""The Markdown tables the benchmarks print (and BENCHMARKS.md keeps)."""

from __future__ import annotations


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A header row, its |---| separator, then a line a row; each cell is written as its str()."""
    return "\n".join([_line(headers), "|" + "---|" * len(headers)] + [_line(row) for row in rows])


def _line(cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"
