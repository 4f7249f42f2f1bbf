"""The stored blobs' meta the service remembers (tier and codec of each conversation's blob, read from its
header once), bounded by bytes: least recently used entries beyond `max_bytes` are forgotten and read
again from the blob's header when asked. Without the bound it held an entry for every conversation ever
offloaded, growing with the history instead of with the load."""

from __future__ import annotations

import json
from collections import OrderedDict

from statekeeper.compression.form import StoredForm


def _size(session_id: str, tier: str, form: StoredForm) -> int:
    """What an entry holds, about: its meta's JSON length plus the record and tuple around it."""
    return len(session_id) + len(tier) + len(json.dumps(form.to_meta(), separators=(",", ":"))) + 200


class BlobMetaCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[str, StoredForm, int]] = OrderedDict()

    def get(self, session_id: str) -> tuple[str | None, StoredForm | None]:
        entry = self._entries.get(session_id)
        if entry is None:
            return None, None
        self._entries.move_to_end(session_id)
        return entry[0], entry[1]

    def put(self, session_id: str, tier: str, form: StoredForm) -> None:
        self.pop(session_id)
        size = _size(session_id, tier, form)
        if size > self.max_bytes:
            return
        self._entries[session_id] = (tier, form, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.bytes -= dropped

    def pop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self.bytes -= entry[2]

    def report(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes}
