"""The shared history store (statekeeper/history/store.py): PostgreSQL, for replicas that serve any
conversation. psycopg 3 with a connection pool; the schema is created and migrated by the service itself
(migrations/*.sql, each applied once in order and recorded in `schema_migrations`, under an advisory lock
so that replicas starting together migrate once).

A turn's commit is one transaction: the conversation's row is locked, its turn count and newest fencing
token compared with the turn's, then the row, the turn's new messages and its index entries written. A
database that cannot be reached (a restart, a failover) is HistoryUnavailable; the pool checks each
connection before lending it, so the store recovers by itself once the database is back."""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections.abc import Iterator
from importlib import resources

import psycopg
from psycopg.types.json import Json
from psycopg_pool import ConnectionPool, PoolTimeout

from statekeeper.history.store import Conversation, HistoryConflict, HistoryStore, HistoryUnavailable, StoredResponse
from statekeeper.prefix_index import prefix_digests, tenant_key

_MIGRATION_LOCK = 0x5354_4B50  # "STKP": pg_advisory_xact_lock's key while the schema is migrated
_CONVERSATION_COLUMNS = ("id, tenant, created_at, updated_at, system, metadata, compression, found_by_messages, "
                         "tokens, tools, template_options, retention")
_TOOL_FIELDS = ("tool_calls", "tool_call_id")  # a message's fields beyond role and content, where present


def migrations() -> list[tuple[int, str]]:
    """(version, SQL) of every migration this statekeeper knows, in order: NNNN_name.sql."""
    folder = resources.files("statekeeper.history") / "migrations"
    found = sorted((int(entry.name.split("_", 1)[0]), entry.read_text()) for entry in folder.iterdir()
                   if entry.name.endswith(".sql"))
    return found


def migrate_schema(connection: psycopg.Connection) -> list[int]:
    """Applies the migrations the database lacks, in the connection's transaction; returns their versions.
    Replicas that start together wait for each other on an advisory lock: one migrates, the rest find it
    done. A database migrated by a newer statekeeper is refused."""
    known = migrations()
    connection.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
    connection.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY, "
                       "applied_at timestamptz NOT NULL DEFAULT now())")
    applied = {row[0] for row in connection.execute("SELECT version FROM schema_migrations")}
    newer = applied - {version for version, _ in known}
    if newer:
        raise RuntimeError(f"the history database has schema versions {sorted(newer)} that this statekeeper "
                           "does not know: run the newer version")
    done = []
    for version, sql in known:
        if version not in applied:
            connection.execute(sql)
            connection.execute("INSERT INTO schema_migrations (version) VALUES (%s)", (version,))
            done.append(version)
    return done


def open_pool(dsn: str, size: int, timeout_s: float, name: str) -> ConnectionPool:
    """A pool that checks each connection before lending it (one broken by a database restart is replaced
    instead of failing the request that drew it). HistoryUnavailable if the database cannot be reached.
    Reconnecting gives up after `timeout_s`: psycopg_pool's default keeps one attempt going for 5 minutes with
    a doubling backoff, so a database back after an outage stayed unused until the next try (seconds to
    minutes later); given up, the next request starts a new attempt at once."""
    pool = ConnectionPool(dsn, min_size=1, max_size=size, open=False, timeout=timeout_s,
                          check=ConnectionPool.check_connection, name=name, reconnect_timeout=timeout_s,
                          kwargs={"connect_timeout": max(1, round(timeout_s))})
    try:
        pool.open(wait=True, timeout=timeout_s)
    except PoolTimeout as exc:
        raise HistoryUnavailable(f"the history database cannot be reached within {timeout_s} s") from exc
    return pool


@contextlib.contextmanager
def transaction(pool: ConnectionPool) -> Iterator[psycopg.Connection]:
    """A connection in a transaction, committed if the block ends normally. Losing the database is
    HistoryUnavailable (the transaction did not commit)."""
    try:
        with pool.connection() as connection, connection.transaction():
            yield connection
    except psycopg.errors.DiskFull:  # an OperationalError too, but the database answered: out of room (507)
        raise
    except (psycopg.OperationalError, PoolTimeout) as exc:
        raise HistoryUnavailable("the history database cannot be reached") from exc


def _token_bytes(tokens: list[int]) -> bytes:
    packed = array("i", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _tokens(data: bytes) -> list[int]:
    packed = array("i")
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def _json(value) -> Json | None:
    return None if value is None else Json(value)


class PostgresHistory(HistoryStore):
    is_shared = True

    def __init__(self, dsn: str, index_key: bytes = b"", pool_size: int = 8, connect_timeout_s: float = 5.0):
        self._index_key = index_key
        self._pool = open_pool(dsn, pool_size, connect_timeout_s, "statekeeper-history")
        self.migrate()

    def _transaction(self):
        return transaction(self._pool)

    def migrate(self) -> list[int]:
        """Applies the migrations the database lacks; returns their versions."""
        with self._transaction() as connection:
            return migrate_schema(connection)

    def schema_versions(self) -> list[int]:
        with self._transaction() as connection:
            return [row[0] for row in connection.execute("SELECT version FROM schema_migrations ORDER BY version")]

    # -- writes ------------------------------------------------------------------------------------

    def save(self, conversation: Conversation) -> None:
        self.save_many([conversation])

    def save_many(self, conversations: list[Conversation]) -> None:
        with self._transaction() as connection:
            for conversation in conversations:
                self._write_whole(connection, conversation)

    def save_new(self, conversation: Conversation, most: int | None = None) -> bool:
        """Counted and saved in one transaction under the tenant's advisory lock: replicas creating at once
        each counted one under the limit and both saved (each held a lock of its own process only)."""
        if most is None:
            self.save(conversation)
            return True
        with self._transaction() as connection:
            connection.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                               (f"statekeeper-tenant:{conversation.tenant}",))
            held = connection.execute("SELECT count(*) FROM conversations WHERE tenant = %s",
                                      (conversation.tenant,)).fetchone()[0]
            if held >= most:
                return False
            self._write_whole(connection, conversation)
        return True

    def _write_whole(self, connection, conversation: Conversation) -> None:
        self._upsert(connection, conversation)
        connection.execute("DELETE FROM messages WHERE conversation_id = %s", (conversation.id,))
        connection.execute("DELETE FROM turn_prefixes WHERE conversation_id = %s", (conversation.id,))
        self._append(connection, conversation, 0)

    def commit_turn(self, conversation: Conversation, expected_turns: int, fence: int | None = None) -> None:
        with self._transaction() as connection:
            row = connection.execute("SELECT turns, fence, message_count FROM conversations WHERE id = %s FOR UPDATE",
                                     (conversation.id,)).fetchone()
            if row is None:
                raise HistoryConflict(f"conversation {conversation.id} is gone: its turn is not committed")
            stored_turns, newest_fence, message_count = row
            if stored_turns != expected_turns:
                raise HistoryConflict(f"conversation {conversation.id} holds {stored_turns} turns, not the "
                                      f"{expected_turns} this turn was computed from: another turn was committed")
            if fence is not None and newest_fence is not None and fence < newest_fence:
                raise HistoryConflict(f"conversation {conversation.id}: the lease with fencing token {fence} "
                                      f"was taken over ({newest_fence} committed since)")
            self._upsert(connection, conversation, fence)
            # A turn only appends to the messages the compare-and-set above found.
            self._append(connection, conversation, message_count)

    def _upsert(self, connection: psycopg.Connection, conversation: Conversation, fence: int | None = None) -> None:
        connection.execute("INSERT INTO tenants (name) VALUES (%s) ON CONFLICT DO NOTHING", (conversation.tenant,))
        connection.execute(
            f"INSERT INTO conversations ({_CONVERSATION_COLUMNS}, turns, message_count, head, fence) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET tenant = excluded.tenant, created_at = excluded.created_at, "
            "updated_at = excluded.updated_at, system = excluded.system, metadata = excluded.metadata, "
            "compression = excluded.compression, found_by_messages = excluded.found_by_messages, "
            "tokens = excluded.tokens, tools = excluded.tools, template_options = excluded.template_options, "
            "retention = excluded.retention, turns = excluded.turns, message_count = excluded.message_count, "
            "head = excluded.head, fence = greatest(conversations.fence, excluded.fence)",
            (conversation.id, conversation.tenant, conversation.created_at, conversation.updated_at,
             _json(conversation.system), _json(conversation.metadata), _json(conversation.compression),
             conversation.found_by_messages, _token_bytes(conversation.tokens), _json(conversation.tools),
             _json(conversation.template_options), _json(conversation.retention),
             conversation.turns,
             len(conversation.messages), self._head(conversation), fence))

    def _append(self, connection: psycopg.Connection, conversation: Conversation, start: int) -> None:
        """Writes messages[start:] and the index entries of the turns among them."""
        new = list(enumerate(conversation.messages))[start:]
        if new:
            with connection.cursor() as cursor:
                cursor.executemany("INSERT INTO messages (conversation_id, position, role, content, tool_fields) "
                                   "VALUES (%s, %s, %s, %s, %s)",
                                   [(conversation.id, i, m["role"], Json(m["content"]),
                                     _json({k: m[k] for k in _TOOL_FIELDS if k in m} or None)) for i, m in new])
        digests = self._turn_prefixes_of(conversation)
        if digests:
            connection.execute("INSERT INTO turn_prefixes (digest, conversation_id) SELECT unnest(%s::bytea[]), %s "
                               "ON CONFLICT DO NOTHING", (digests, conversation.id))

    def set_retention(self, session_id: str, retention: dict | None) -> bool:
        with self._transaction() as connection:
            return connection.execute("UPDATE conversations SET retention = %s WHERE id = %s",
                                      (_json(retention), session_id)).rowcount > 0

    def own_retention(self, tenant: str | None = None) -> dict[str, dict]:
        with self._transaction() as connection:
            rows = connection.execute("SELECT id, retention FROM conversations WHERE retention IS NOT NULL "
                                      "AND (%s::text IS NULL OR tenant = %s)", (tenant, tenant)).fetchall()
        return {session_id: retention for session_id, retention in rows if retention}

    def tenant_retention(self) -> dict[str, dict]:
        with self._transaction() as connection:
            return dict(connection.execute("SELECT tenant, retention FROM tenant_retention").fetchall())

    def set_tenant_retention(self, tenant: str, retention: dict | None) -> None:
        with self._transaction() as connection:
            if retention is None:
                connection.execute("DELETE FROM tenant_retention WHERE tenant = %s", (tenant,))
            else:
                connection.execute("INSERT INTO tenant_retention (tenant, retention) VALUES (%s, %s) "
                                   "ON CONFLICT (tenant) DO UPDATE SET retention = excluded.retention",
                                   (tenant, Json(retention)))

    def delete(self, session_id: str) -> bool:
        with self._transaction() as connection:  # its messages and index entries go with it (cascade)
            return connection.execute("DELETE FROM conversations WHERE id = %s", (session_id,)).rowcount > 0

    # -- reads -------------------------------------------------------------------------------------

    def load(self, session_id: str) -> Conversation | None:
        with self._transaction() as connection:
            # One snapshot for both statements: under READ COMMITTED a turn committed between them gave the
            # row of one state and the messages of the next
            connection.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            row = connection.execute(f"SELECT {_CONVERSATION_COLUMNS} FROM conversations WHERE id = %s",
                                     (session_id,)).fetchone()
            if row is None:
                return None
            messages = connection.execute("SELECT role, content, tool_fields FROM messages WHERE conversation_id = %s "
                                          "ORDER BY position", (session_id,)).fetchall()
        (id_, tenant, created_at, updated_at, system, metadata, compression, found_by_messages, tokens, tools, options,
         retention) = row
        return Conversation(id=id_, created_at=created_at, system=system, metadata=metadata,
                            messages=[{"role": role, "content": content} | (fields or {})
                                      for role, content, fields in messages],
                            tokens=_tokens(tokens), compression=compression, tenant=tenant,
                            found_by_messages=found_by_messages, updated_at=updated_at, tools=tools,
                            template_options=options, retention=retention)

    def exists(self, session_id: str) -> bool:
        with self._transaction() as connection:
            return connection.execute("SELECT 1 FROM conversations WHERE id = %s", (session_id,)).fetchone() is not None

    def existing(self, session_ids: list[str]) -> set[str]:
        if not session_ids:
            return set()
        with self._transaction() as connection:
            return {row[0] for row in connection.execute("SELECT id FROM conversations WHERE id = ANY(%s)",
                                                         (list(session_ids),))}

    def ids(self) -> list[str]:
        with self._transaction() as connection:
            return [row[0] for row in connection.execute("SELECT id FROM conversations ORDER BY id")]

    def page(self, prefix: str = "", after: str = "", limit: int = 50) -> list[str]:
        pattern = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        with self._transaction() as connection:
            rows = connection.execute("SELECT id FROM conversations WHERE id LIKE %s AND id > %s ORDER BY id LIMIT %s",
                                      (pattern, after, limit))
            return [row[0] for row in rows]

    def find_heads(self, messages: list[dict], tenant: str = "") -> list[tuple[str, int]]:
        digests = prefix_digests(tenant_key(self._index_key, tenant), messages)
        if not digests:
            return []
        length_of = {digest: length for length, digest in enumerate(digests, start=1)}
        with self._transaction() as connection:
            rows = connection.execute("SELECT id, head FROM conversations WHERE head = ANY(%s)", (digests,)).fetchall()
        return sorted(((id_, length_of[bytes(head)]) for id_, head in rows), key=lambda found: (-found[1], found[0]))

    def find_branch(self, messages: list[dict], tenant: str = "") -> tuple[list[str], int]:
        digests = prefix_digests(tenant_key(self._index_key, tenant), messages)
        replies = [digest for digest, message in zip(digests, messages) if message["role"] == "assistant"]
        if not replies:
            return [], 0
        length_of = {digest: length for length, digest in enumerate(digests, start=1)}
        with self._transaction() as connection:
            rows = connection.execute("SELECT digest, conversation_id FROM turn_prefixes WHERE digest = ANY(%s)",
                                      (replies,)).fetchall()
        if not rows:
            return [], 0
        longest = max(length_of[bytes(digest)] for digest, _ in rows)
        return sorted(id_ for digest, id_ in rows if length_of[bytes(digest)] == longest), longest

    def count(self, tenant: str) -> int:
        with self._transaction() as connection:
            return connection.execute("SELECT count(*) FROM conversations WHERE tenant = %s", (tenant,)).fetchone()[0]

    def tenant_ids(self, tenant: str) -> list[str]:
        with self._transaction() as connection:
            return [row[0] for row in connection.execute("SELECT id FROM conversations WHERE tenant = %s ORDER BY id",
                                                         (tenant,))]

    def tenants(self) -> list[str]:
        with self._transaction() as connection:
            rows = connection.execute("SELECT name FROM tenants WHERE EXISTS "
                                      "(SELECT 1 FROM conversations WHERE tenant = tenants.name) ORDER BY name")
            return [row[0] for row in rows]

    # -- stored responses --------------------------------------------------------------------------

    def save_response(self, response: StoredResponse) -> None:
        try:
            with self._transaction() as connection:
                connection.execute("INSERT INTO responses (id, tenant, conversation_id, message_count, body) "
                                   "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (id) DO UPDATE SET tenant = "
                                   "excluded.tenant, conversation_id = excluded.conversation_id, message_count = "
                                   "excluded.message_count, body = excluded.body",
                                   (response.id, response.tenant, response.conversation_id, response.message_count,
                                    Json(response.body)))
        except psycopg.errors.ForeignKeyViolation:  # its conversation was deleted meanwhile: nothing to keep
            return

    def load_response(self, response_id: str) -> StoredResponse | None:
        with self._transaction() as connection:
            row = connection.execute("SELECT tenant, conversation_id, message_count, body FROM responses WHERE id = %s",
                                     (response_id,)).fetchone()
        return None if row is None else StoredResponse(response_id, *row)

    def delete_response(self, response_id: str) -> bool:
        with self._transaction() as connection:
            return connection.execute("DELETE FROM responses WHERE id = %s", (response_id,)).rowcount > 0

    # -- health ------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        with self._transaction() as connection:
            connection.execute("INSERT INTO healthz (id, checked_at) VALUES (1, now()) "
                               "ON CONFLICT (id) DO UPDATE SET checked_at = excluded.checked_at")

    def close(self) -> None:
        self._pool.close()
