"""What every history store is: the durable source of truth for conversations (KV is only a cache of it).

A store keeps each conversation (its messages, system prompt, metadata and the exact token ids fed to the
model), the index that finds a conversation by its whole history (statekeeper/prefix_index.py), each
tenant's conversations (counted for the tenant's limits) and the stored responses of OpenAI's Responses
API. Two implementations: LMDB (lmdb.py, embedded, one process) and PostgreSQL (postgres.py, shared by
replicas).

A turn is committed with `commit_turn`: once or not at all, and only onto the history it was computed
from (compare-and-set on the conversation's turn count), by the holder of the newest lease (its fencing
token, statekeeper/coordination.py), so a replica that lost its lease mid-turn cannot commit over
another's turn."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from statekeeper.prefix_index import head_digest, tenant_key, turn_prefixes


@dataclass(slots=True)
class Conversation:
    id: str
    created_at: str
    system: str | None = None
    metadata: dict | None = None
    messages: list[dict] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    compression: dict | None = None  # per-session CompressionConfig overrides
    tenant: str = ""  # statekeeper.tenancy: the tenant whose API key created it ("" without API keys)
    # Started by a client that resends its messages (OpenAI's API): found again by them, and extended by
    # whoever resends them. A /v1/sessions conversation is continued only by its id, so another client that
    # happens to send the same history never extends it.
    found_by_messages: bool = False
    updated_at: str | None = None  # when its last turn was committed (None: no turn yet)
    tools: list[dict] | None = None  # the functions its last turn offered the model (OpenAI's `tools`)
    template_options: dict | None = None  # the chat template's variables its last turn rendered with
    retention: dict | None = None  # its own retention settings (statekeeper/placement/retention.py), if any

    @property
    def turns(self) -> int:
        return sum(1 for message in self.messages if message["role"] == "assistant")

    def chat_messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return system + self.messages


@dataclass(slots=True)
class StoredResponse:
    """A response of the Responses API: it answered `conversation_id` when the conversation held
    `message_count` messages (system prompt not counted), the last of them its own reply."""

    id: str
    tenant: str
    conversation_id: str
    message_count: int
    body: dict  # as the API returned it


class HistoryConflict(Exception):
    """A turn's commit was refused: the conversation is gone, has moved on since the turn read it
    (another turn was committed meanwhile), or a newer lease holder has committed (a stale fencing token).
    Nothing was written."""


class HistoryUnavailable(Exception):
    """The store cannot be reached now (a database outage); nothing was written. Asking again later may
    succeed: the store reconnects by itself."""


class HistoryStore(abc.ABC):
    """The history interface. Every method may block: the service calls them on its I/O threads."""

    # Whether other processes (replicas) write this history too: then what a process holds in memory may
    # be behind, and a turn starts from the stored conversation.
    is_shared: bool = False
    _index_key: bytes  # keys the index digests (STATEKEEPER_INDEX_SECRET): set by each store

    def _turn_prefixes_of(self, conversation: Conversation) -> list[bytes]:
        """The index digests of every prefix of the conversation that ends with a reply (branch lookup)."""
        if not conversation.found_by_messages:
            return []
        return turn_prefixes(tenant_key(self._index_key, conversation.tenant), conversation.chat_messages())

    def _head(self, conversation: Conversation) -> bytes | None:
        """The index digest of the conversation's whole history (how a client resending it finds it)."""
        if not conversation.found_by_messages:
            return None
        return head_digest(tenant_key(self._index_key, conversation.tenant), conversation.chat_messages())

    @abc.abstractmethod
    def save(self, conversation: Conversation) -> None:
        """Writes a conversation whole (a new one, or an import over an old one)."""

    def save_new(self, conversation: Conversation, most: int | None = None) -> bool:
        """Saves a new conversation unless its tenant holds `most` already (None: no limit); whether it saved.
        Here counted, then saved: one process writes an unshared history, and the service does both under a
        lock of its own. A shared history does both as one step across replicas."""
        if most is not None and self.count(conversation.tenant) >= most:
            return False
        self.save(conversation)
        return True

    @abc.abstractmethod
    def save_many(self, conversations: list[Conversation]) -> None:
        """Saves conversations in one transaction: all or none (an import, or a benchmark's fill)."""

    @abc.abstractmethod
    def commit_turn(self, conversation: Conversation, expected_turns: int, fence: int | None = None) -> None:
        """Commits a finished turn: `conversation` as it is after the turn, which was computed from the
        stored conversation when it held `expected_turns` turns. Raises HistoryConflict, writing nothing,
        if the stored conversation is missing or holds another number of turns, or if `fence` (the turn's
        lease's fencing token; None: no coordination) is older than the newest one committed."""

    @abc.abstractmethod
    def set_retention(self, session_id: str, retention: dict | None) -> bool:
        """Replaces the conversation's retention settings and nothing else (a turn another replica commits
        meanwhile is kept); False if there is no such conversation."""

    @abc.abstractmethod
    def own_retention(self, tenant: str | None = None) -> dict[str, dict]:
        """The conversations with retention settings of their own, by id, of `tenant` (None: of every one)."""

    @abc.abstractmethod
    def tenant_retention(self) -> dict[str, dict]:
        """The retention defaults set for tenants at run time, by tenant ("*": every tenant)."""

    @abc.abstractmethod
    def set_tenant_retention(self, tenant: str, retention: dict | None) -> None:
        """Replaces the tenant's retention defaults (None: removes them)."""

    @abc.abstractmethod
    def load(self, session_id: str) -> Conversation | None: ...

    @abc.abstractmethod
    def delete(self, session_id: str) -> bool: ...

    @abc.abstractmethod
    def exists(self, session_id: str) -> bool: ...

    @abc.abstractmethod
    def existing(self, session_ids: list[str]) -> set[str]:
        """Which of `session_ids` are stored, in one look (a replica's sweep over what it holds in memory)."""

    @abc.abstractmethod
    def ids(self) -> list[str]: ...

    @abc.abstractmethod
    def page(self, prefix: str = "", after: str = "", limit: int = 50) -> list[str]:
        """Up to `limit` conversation ids that start with `prefix`, in byte order, after `after` (the admin
        dashboard's table): a range scan, never a walk of every id."""

    @abc.abstractmethod
    def find_heads(self, messages: list[dict], tenant: str = "") -> list[tuple[str, int]]:
        """The tenant's conversations whose whole history may be a prefix of `messages`, longest first: (id,
        number of messages its history covers). Candidates only: the caller compares the messages."""

    @abc.abstractmethod
    def find_branch(self, messages: list[dict], tenant: str = "") -> tuple[list[str], int]:
        """The tenant's conversations that share the longest prefix of `messages` ending with a reply, and
        its length in messages; ([], 0) if none. Candidates only: the caller compares the tokens."""

    @abc.abstractmethod
    def count(self, tenant: str) -> int:
        """How many conversations the tenant has."""

    @abc.abstractmethod
    def tenant_ids(self, tenant: str) -> list[str]: ...

    @abc.abstractmethod
    def tenants(self) -> list[str]:
        """Every tenant with a conversation."""

    @abc.abstractmethod
    def save_response(self, response: StoredResponse) -> None:
        """Kept until deleted, or until its conversation is: `delete` takes the conversation's responses."""

    @abc.abstractmethod
    def load_response(self, response_id: str) -> StoredResponse | None: ...

    @abc.abstractmethod
    def delete_response(self, response_id: str) -> bool: ...

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Raises unless a write would succeed now (GET /healthz)."""

    @abc.abstractmethod
    def close(self) -> None: ...
