"""Durable conversation history in LMDB: the source of truth. KV is only a cache of it.

Two records per conversation, written in one transaction: `sessions` holds JSON (messages, system,
metadata), `tokens` the exact token ids fed to the model as int32. A turn is committed only after it
completed, so a crash or a failed turn leaves the previous state intact."""

from __future__ import annotations

import errno
import json
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lmdb

_MAP_SIZE = 64 << 30  # virtual; the file grows only as data is written


@dataclass(slots=True)
class Conversation:
    id: str
    created_at: str
    system: str | None = None
    metadata: dict | None = None
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    compression: dict | None = None  # per-session CompressionConfig overrides

    @property
    def turns(self) -> int:
        return sum(1 for message in self.messages if message["role"] == "assistant")

    def chat_messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + self.messages


def is_out_of_space(exc: BaseException) -> bool:
    """Whether a failed write failed for room: the LMDB map is full, or the disk (or quota) under it. The
    transaction was aborted, so the store holds what it held before."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class HistoryStore:
    def __init__(self, path: Path, map_size: int = _MAP_SIZE):
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=2)
        self._sessions = self._env.open_db(b"sessions")
        self._tokens = self._env.open_db(b"tokens")

    def save(self, conversation: Conversation) -> None:
        record = asdict(conversation)
        tokens = array("i", record.pop("tokens")).tobytes()
        key = conversation.id.encode()
        with self._env.begin(write=True) as txn:
            txn.put(key, json.dumps(record).encode(), db=self._sessions)
            txn.put(key, tokens, db=self._tokens)

    def load(self, session_id: str) -> Conversation | None:
        key = session_id.encode()
        with self._env.begin() as txn:
            record = txn.get(key, db=self._sessions)
            tokens = txn.get(key, db=self._tokens)
        if record is None:
            return None
        token_array = array("i")
        token_array.frombytes(tokens or b"")
        return Conversation(**json.loads(record), tokens=token_array.tolist())

    def delete(self, session_id: str) -> bool:
        key = session_id.encode()
        with self._env.begin(write=True) as txn:
            found = txn.delete(key, db=self._sessions)
            txn.delete(key, db=self._tokens)
        return found

    def exists(self, session_id: str) -> bool:
        with self._env.begin() as txn:
            return txn.get(session_id.encode(), db=self._sessions) is not None

    def ids(self) -> list[str]:
        with self._env.begin() as txn:
            return [bytes(key).decode() for key in txn.cursor(db=self._sessions).iternext(values=False)]

    def check_writable(self) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(b"__healthz__", b"1", db=self._sessions)
            txn.delete(b"__healthz__", db=self._sessions)

    def close(self) -> None:
        self._env.close()
