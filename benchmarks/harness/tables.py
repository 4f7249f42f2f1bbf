"""The Markdown tables the benchmarks print (and BENCHMARKS.md keeps)."""

from __future__ import annotations


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A header row, its |---| separator, then a line a row; each cell is written as its str()."""
    return "\n".join([_line(headers), "|" + "---|" * len(headers)] + [_line(row) for row in rows])


def _line(cells) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


class StreamedTable:
    """A Markdown table printed a row at a time as a long benchmark measures it (the header before the first
    row), so a run shows its progress and a stopped one keeps what it measured; the same lines as
    markdown_table."""

    def __init__(self, headers: list[str]):
        self.headers = headers
        self._started = False

    def row(self, cells: list) -> None:
        if len(cells) != len(self.headers):
            raise ValueError(f"{len(cells)} cells for {len(self.headers)} columns")
        if not self._started:
            print(_line(self.headers) + "\n|" + "---|" * len(self.headers), flush=True)
            self._started = True
        print(_line(cells), flush=True)
