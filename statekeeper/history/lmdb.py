"""The embedded history store (statekeeper/history/store.py): LMDB, one process, `make serve`'s default.

Two records per conversation, written in one transaction: `sessions` holds JSON (messages, system,
metadata), `tokens` the exact token ids fed to the model as int32. A turn is committed only after it
completed, so a crash or a failed turn leaves the previous state intact. In the same transaction the
store keeps the index that finds a conversation by its whole history (statekeeper/prefix_index.py):
`conversation-heads` maps the digest of a conversation's chat messages to its id (to several: two users
who said the same and got the same greedy reply have the same history), `head-of` each id to its digest,
`turn-prefixes` the digest of every prefix of its history that ends with a reply to its id (a client
that edited a later turn branches off there);
and `tenant-conversations` each tenant to its conversations' ids (counted for the tenant's limits).
`responses` keeps the stored responses of OpenAI's Responses API: each one's body and the point of its
conversation it answered (StoredResponse). `fences` keeps the newest fencing token a turn was committed
with, per conversation (base.py: a stale lease holder cannot commit); `tenant-retention` the retention defaults
an admin set for a tenant at run time (JSON)."""

from __future__ import annotations

import errno
import json
from array import array
from dataclasses import asdict
from pathlib import Path

import lmdb

from statekeeper.history.store import Conversation, HistoryConflict, HistoryStore, StoredResponse
from statekeeper.prefix_index import prefix_digests, tenant_key

_MAP_SIZE = 64 << 30  # virtual; the file grows only as data is written
# Pages a save leaves free. LMDB copies on write, so in a map filled to the last page even a delete
# fails for room, and a full store could then never be emptied: saves stop this far short of full.
_RESERVE_PAGES = 24
_HEALTH_KEY = b"__healthz__"  # written and deleted again by the health check
_TENANT_PREFIX = b"t:"  # LMDB keys are never empty, and the default tenant's name is ""


def _tenant_key(tenant: str) -> bytes:
    return _TENANT_PREFIX + tenant.encode()


def _tenant_of(key: bytes) -> str:
    return bytes(key)[len(_TENANT_PREFIX):].decode()


def is_out_of_space(exc: BaseException) -> bool:
    """Whether a failed write failed for room: the LMDB map is full, or the disk (or quota) under it. The
    transaction was aborted, so the store holds what it held before."""
    if isinstance(exc, (lmdb.MapFullError, lmdb.DiskError)):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class LmdbHistory(HistoryStore):
    def __init__(self, path: Path, map_size: int = _MAP_SIZE, index_key: bytes = b""):
        path.mkdir(parents=True, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=map_size, max_dbs=10)
        self._sessions = self._env.open_db(b"sessions")
        self._tokens = self._env.open_db(b"tokens")
        self._heads = self._env.open_db(b"conversation-heads", dupsort=True)  # several share a history
        self._head_of = self._env.open_db(b"head-of")
        self._by_tenant = self._env.open_db(b"tenant-conversations", dupsort=True)
        self._responses = self._env.open_db(b"responses")
        self._turn_prefixes = self._env.open_db(b"turn-prefixes", dupsort=True)
        self._fences = self._env.open_db(b"fences")
        self._responses_of = self._env.open_db(b"conversation-responses", dupsort=True)  # go with it when deleted
        self._tenant_retention = self._env.open_db(b"tenant-retention")
        self._databases = (self._sessions, self._tokens, self._heads, self._head_of, self._by_tenant, self._responses,
                           self._turn_prefixes, self._fences, self._responses_of, self._tenant_retention)
        self._index_key = index_key
        self._index_tenants()

    def _index_tenants(self) -> None:
        """Once, for a store written before the tenant index existed: every conversation into it."""
        with self._env.begin(write=True) as txn:
            if txn.stat(self._by_tenant)["entries"] or not txn.stat(self._sessions)["entries"]:
                return
            for key, value in txn.cursor(db=self._sessions):
                if bytes(key) != _HEALTH_KEY:
                    txn.put(_tenant_key(json.loads(value).get("tenant", "")), bytes(key), db=self._by_tenant)

    def save(self, conversation: Conversation) -> None:
        self.save_many([conversation])

    def save_many(self, conversations: list[Conversation]) -> None:
        with self._env.begin(write=True) as txn:
            for conversation in conversations:
                self._put(txn, conversation)

    def commit_turn(self, conversation: Conversation, expected_turns: int, fence: int | None = None) -> None:
        key = conversation.id.encode()
        with self._env.begin(write=True) as txn:
            record = txn.get(key, db=self._sessions)
            if record is None:
                raise HistoryConflict(f"conversation {conversation.id} is gone: its turn is not committed")
            stored_turns = Conversation(**json.loads(record)).turns
            if stored_turns != expected_turns:
                raise HistoryConflict(f"conversation {conversation.id} holds {stored_turns} turns, not the "
                                      f"{expected_turns} this turn was computed from: another turn was committed")
            if fence is not None:
                newest = txn.get(key, db=self._fences)
                if newest is not None and fence < int(newest):
                    raise HistoryConflict(f"conversation {conversation.id}: the lease with fencing token {fence} "
                                          f"was taken over ({int(newest)} committed since)")
                txn.put(key, str(fence).encode(), db=self._fences)
            self._put(txn, conversation)

    def set_retention(self, session_id: str, retention: dict | None) -> bool:
        key = session_id.encode()
        with self._env.begin(write=True) as txn:
            record = txn.get(key, db=self._sessions)
            if record is None:
                return False
            fields = json.loads(record) | {"retention": retention}
            value = json.dumps(fields).encode()
            self._check_room(txn, len(key) + len(value))
            txn.put(key, value, db=self._sessions)
            return True

    def own_retention(self, tenant: str | None = None) -> dict[str, dict]:
        with self._env.begin() as txn:
            if tenant is None:
                records = ((bytes(key), value) for key, value in txn.cursor(db=self._sessions)
                           if bytes(key) != _HEALTH_KEY)
            else:
                cursor = txn.cursor(db=self._by_tenant)
                keys = [bytes(key) for key in cursor.iternext_dup()] if cursor.set_key(_tenant_key(tenant)) else []
                records = ((key, txn.get(key, db=self._sessions)) for key in keys)
            settings = {key.decode(): json.loads(value).get("retention") for key, value in records if value is not None}
        return {session_id: own for session_id, own in settings.items() if own}

    def tenant_retention(self) -> dict[str, dict]:
        with self._env.begin() as txn:
            return {_tenant_of(key): json.loads(value) for key, value in txn.cursor(db=self._tenant_retention)}

    def set_tenant_retention(self, tenant: str, retention: dict | None) -> None:
        key = _tenant_key(tenant)
        with self._env.begin(write=True) as txn:
            if retention is None:
                txn.delete(key, db=self._tenant_retention)
                return
            value = json.dumps(retention).encode()
            self._check_room(txn, len(key) + len(value))
            txn.put(key, value, db=self._tenant_retention)

    def _put(self, txn, conversation: Conversation) -> None:
        record = asdict(conversation)
        tokens = array("i", record.pop("tokens")).tobytes()
        key = conversation.id.encode()
        value = json.dumps(record).encode()
        self._check_room(txn, len(key) + len(value) + len(tokens))
        txn.put(key, value, db=self._sessions)
        txn.put(key, tokens, db=self._tokens)
        txn.put(_tenant_key(conversation.tenant), key, db=self._by_tenant)  # a no-op once there
        self._move_head(txn, key, self._head(conversation))
        for digest in self._turn_prefixes_of(conversation):  # the earlier ones are there already
            txn.put(digest, key, db=self._turn_prefixes)

    def _check_room(self, txn, size: int) -> None:
        """Refuses (as a full map) a write that would leave fewer than _RESERVE_PAGES pages free. Pages in
        use are what the databases hold; pages they freed are reused, so they count as free."""
        main = self._env.stat()
        used = sum(stat[kind] for stat in (main, *(txn.stat(db) for db in self._databases))
                   for kind in ("branch_pages", "leaf_pages", "overflow_pages"))
        page = main["psize"]
        free = self._env.info()["map_size"] // page - 2 - used  # two meta pages
        if free < _RESERVE_PAGES + 2 * (size // page + 1):  # the record's pages, counted twice for the tree
            raise lmdb.MapFullError("the history store is full (pages kept free for deletes)")

    def _move_head(self, txn, key: bytes, head: bytes | None) -> None:
        """Points the index at the conversation's new head, leaving other conversations at its old one."""
        old = txn.get(key, db=self._head_of)
        if old == head:
            return
        if old is not None:
            txn.delete(old, key, db=self._heads)
            txn.delete(key, db=self._head_of)
        if head is not None:
            txn.put(head, key, db=self._heads)
            txn.put(key, head, db=self._head_of)

    def find_heads(self, messages: list[dict], tenant: str = "") -> list[tuple[str, int]]:
        """The tenant's conversations whose whole history may be a prefix of `messages`, longest first: (id,
        number of messages its history covers). Candidates only: the caller compares the messages."""
        digests = prefix_digests(tenant_key(self._index_key, tenant), messages)
        found = []
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._heads)
            for length in range(len(digests), 0, -1):
                if cursor.set_key(digests[length - 1]):
                    found += [(bytes(key).decode(), length) for key in cursor.iternext_dup()]
        return found

    def find_branch(self, messages: list[dict], tenant: str = "") -> tuple[list[str], int]:
        """The tenant's conversations that share the longest prefix of `messages` ending with a reply, and
        its length in messages; ([], 0) if none. Candidates only: the caller compares the tokens."""
        digests = prefix_digests(tenant_key(self._index_key, tenant), messages)
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._turn_prefixes)
            for length in range(len(digests), 0, -1):
                if messages[length - 1]["role"] == "assistant" and cursor.set_key(digests[length - 1]):
                    return [bytes(key).decode() for key in cursor.iternext_dup()], length
        return [], 0

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
            record = txn.get(key, db=self._sessions)
            if record is not None:
                stored = Conversation(**json.loads(record))
                txn.delete(_tenant_key(stored.tenant), key, db=self._by_tenant)
                for digest in self._turn_prefixes_of(stored):
                    txn.delete(digest, key, db=self._turn_prefixes)
            found = txn.delete(key, db=self._sessions)
            responses = txn.cursor(db=self._responses_of)
            if responses.set_key(key):
                for response_id in list(responses.iternext_dup()):
                    txn.delete(bytes(response_id), db=self._responses)
                txn.delete(key, db=self._responses_of)
            txn.delete(key, db=self._tokens)
            txn.delete(key, db=self._fences)
            self._move_head(txn, key, None)
        return found

    def count(self, tenant: str) -> int:
        """How many conversations the tenant has."""
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._by_tenant)
            return cursor.count() if cursor.set_key(_tenant_key(tenant)) else 0

    def tenant_ids(self, tenant: str) -> list[str]:
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._by_tenant)
            if not cursor.set_key(_tenant_key(tenant)):
                return []
            return [bytes(key).decode() for key in cursor.iternext_dup()]

    def tenants(self) -> list[str]:
        """Every tenant with a conversation."""
        with self._env.begin() as txn:
            keys = txn.cursor(db=self._by_tenant).iternext_nodup(keys=True, values=False)
            return [_tenant_of(key) for key in keys]

    def save_response(self, response: StoredResponse) -> None:
        record = asdict(response)
        key, value = record.pop("id").encode(), json.dumps(record).encode()
        with self._env.begin(write=True) as txn:
            self._check_room(txn, len(key) + len(value))
            txn.put(key, value, db=self._responses)
            txn.put(response.conversation_id.encode(), key, db=self._responses_of)

    def load_response(self, response_id: str) -> StoredResponse | None:
        """None also for a response whose conversation is gone (one stored before deletes took them along)."""
        with self._env.begin() as txn:
            value = txn.get(response_id.encode(), db=self._responses)
            if value is None:
                return None
            response = StoredResponse(id=response_id, **json.loads(value))
            return response if txn.get(response.conversation_id.encode(), db=self._sessions) is not None else None

    def delete_response(self, response_id: str) -> bool:
        with self._env.begin(write=True) as txn:
            value = txn.get(response_id.encode(), db=self._responses)
            if value is None:
                return False
            txn.delete(json.loads(value)["conversation_id"].encode(), response_id.encode(), db=self._responses_of)
            return txn.delete(response_id.encode(), db=self._responses)

    def exists(self, session_id: str) -> bool:
        with self._env.begin() as txn:
            return txn.get(session_id.encode(), db=self._sessions) is not None

    def existing(self, session_ids: list[str]) -> set[str]:
        with self._env.begin() as txn:
            return {session_id for session_id in session_ids 
                    if txn.get(session_id.encode(), db=self._sessions) is not None}

    def ids(self) -> list[str]:
        with self._env.begin() as txn:
            return [bytes(key).decode() for key in txn.cursor(db=self._sessions).iternext(values=False)]

    def page(self, prefix: str = "", after: str = "", limit: int = 50) -> list[str]:
        """Up to `limit` conversation ids that start with `prefix`, in key order, after `after`: a range
        scan of the sorted keys (the admin dashboard's table), never a walk of every id."""
        stem, last = prefix.encode(), after.encode()
        start = max(stem, last)
        found: list[str] = []
        with self._env.begin() as txn:
            cursor = txn.cursor(db=self._sessions)
            if not cursor.set_range(start):
                return found
            for key in cursor.iternext(values=False):
                key = bytes(key)
                if not key.startswith(stem) or len(found) >= limit:
                    break
                if key == _HEALTH_KEY or (last and key <= last):
                    continue
                found.append(key.decode())
        return found

    def check_writable(self) -> None:
        with self._env.begin(write=True) as txn:
            txn.put(_HEALTH_KEY, b"1", db=self._sessions)
            txn.delete(_HEALTH_KEY, db=self._sessions)

    def close(self) -> None:
        self._env.close()
