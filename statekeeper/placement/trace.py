"""The trace of a service's traffic the placement simulator replays: one JSON line a turn (when it came, its
conversation and tenant by tag, the tokens it added). No text. The service writes one of its own when TRACE_FILE
is set (TraceWriter); statekeeper/simulation/synthetic.py draws synthetic ones."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class TraceTurn:
    time_s: float  # when the turn's request arrives, from the trace's start
    conversation: str
    prompt_tokens: int  # the new message's tokens (with its template's)
    reply_tokens: int
    tenant: str = ""
    duration_s: float = 0.0  # from the request to the reply's end: the conversation is idle from then on


def write(turns: Iterable[TraceTurn], path: Path) -> None:
    with path.open("w") as out:
        for turn in turns:
            out.write(json.dumps(asdict(turn)) + "\n")


def read(path: Path) -> Iterator[TraceTurn]:
    with path.open() as lines:
        for line in lines:
            if line.strip():
                yield TraceTurn(**json.loads(line))


class TraceWriter:
    """Appends the service's own turns to a trace (TRACE_FILE) the simulator replays: conversations and tenants
    by a hash of their ids, Unix times, token counts; no text."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", buffering=1)  # a line at a time: a crash loses at most the turn being written
        self._lock = threading.Lock()

    def turn(self, time_s: float, conversation_id: str, tenant: str, prompt_tokens: int, reply_tokens: int,
             duration_s: float = 0.0) -> None:
        line = json.dumps(asdict(TraceTurn(round(time_s, 3), tag(conversation_id), max(1, prompt_tokens),
                                           reply_tokens, tag(tenant) if tenant else "", round(duration_s, 3))))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def tag(identifier: str) -> str:
    """How a trace names a conversation or a tenant: a hash of its id."""
    return hashlib.blake2b(identifier.encode(), digest_size=8).hexdigest()
