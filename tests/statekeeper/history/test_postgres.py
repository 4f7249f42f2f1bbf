"""What only the PostgreSQL history has: a schema the service migrates itself, and outages."""

import time
import threading

import psycopg
import pytest

from statekeeper.history import Conversation, HistoryUnavailable
from statekeeper.history.postgres import PostgresHistory, migrations
from benchmarks.harness.postgres_server import PostgresServer, missing_reason
from benchmarks.harness.redis_server import free_port


def test_the_schema_is_created_once_and_recorded(postgres_dsn):
    known = [version for version, _ in migrations()]
    assert known == sorted(set(known)) and known[0] == 1
    stores, barrier = [], threading.Barrier(4)

    def start():  # replicas starting together: the advisory lock lets one migrate
        barrier.wait()
        stores.append(PostgresHistory(postgres_dsn, pool_size=1))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(stores) == 4 and all(store.schema_versions() == known for store in stores)
    assert stores[0].migrate() == []  # nothing left to apply
    with psycopg.connect(postgres_dsn) as connection:
        tables = {row[0] for row in connection.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'")}
        assert {"schema_migrations", "tenants", "conversations", "messages", "turn_prefixes", "responses"} <= tables
        assert connection.execute("SELECT count(*) FROM schema_migrations").fetchone()[0] == len(known)
    for store in stores:
        store.close()


def test_a_schema_newer_than_this_statekeeper_is_refused(postgres_dsn):
    PostgresHistory(postgres_dsn).close()
    with psycopg.connect(postgres_dsn) as connection:
        connection.execute("INSERT INTO schema_migrations (version) VALUES (9999)")
    with pytest.raises(RuntimeError, match="9999"):
        PostgresHistory(postgres_dsn)


def test_a_database_that_cannot_be_reached_is_unavailable_not_a_crash():
    with pytest.raises(HistoryUnavailable):
        PostgresHistory(f"postgresql://postgres@127.0.0.1:{free_port()}/none", connect_timeout_s=1)


@pytest.mark.skipif(missing_reason() is not None, reason=missing_reason() or "")
def test_the_store_recovers_by_itself_after_a_database_restart():
    server = PostgresServer().start()
    try:
        store = PostgresHistory(server.create_database(), pool_size=2, connect_timeout_s=1)
        store.save(Conversation(id="c1", created_at="now"))
        server.stop()
        with pytest.raises(HistoryUnavailable):
            store.load("c1")
        with pytest.raises(HistoryUnavailable):
            store.save(Conversation(id="c2", created_at="now"))
        time.sleep(3)  # an outage of a few seconds: the pool's reconnection attempts back off meanwhile
        server.start()
        assert store.load("c1") == Conversation(id="c1", created_at="now") and not store.exists("c2")
        store.check_writable()
        store.close()
    finally:
        server.remove()


def test_a_full_disk_is_out_of_space_not_unreachable(postgres_dsn):
    """psycopg's DiskFull is an OperationalError, which the store reports as a database it cannot reach: the
    client got a 503 and asked again against a full disk, where a 507 says to wait for room."""
    from statekeeper.history import is_out_of_space
    from statekeeper.sessions.errors import as_refusal

    store = PostgresHistory(postgres_dsn, pool_size=2)
    with psycopg.connect(postgres_dsn, autocommit=True) as admin:  # every insert fails as on a full disk (53100)
        admin.execute("CREATE FUNCTION full_disk() RETURNS trigger LANGUAGE plpgsql AS "
                      "$$ BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = 'disk_full'; END $$")
        admin.execute("CREATE TRIGGER disk_is_full BEFORE INSERT ON conversations FOR EACH ROW "
                      "EXECUTE FUNCTION full_disk()")
    try:
        with pytest.raises(Exception) as failed:
            store.save(Conversation(id="c1", created_at="2026-11-28T00:00:00+00:00"))
        assert is_out_of_space(failed.value) and as_refusal(failed.value).status == 507
    finally:
        store.close()


def test_a_load_sees_one_commit_not_the_row_of_one_and_the_messages_of_the_next(postgres_dsn, monkeypatch):
    """load() read the conversation's row and its messages in two statements of a READ COMMITTED transaction: a
    turn committed between them (another replica, no lease) gave the tokens of one state and the messages of
    the next, a history that never existed."""
    import dataclasses

    store, other = PostgresHistory(postgres_dsn, pool_size=2), PostgresHistory(postgres_dsn, pool_size=2)
    before = Conversation(id="c1", created_at="2026-11-28T00:00:00+00:00", tokens=[1, 2, 3],
                          messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}])
    store.save(before)
    after = dataclasses.replace(before, tokens=[1, 2, 3, 4, 5], messages=before.messages + [
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "Then more."}])
    execute, armed = psycopg.Connection.execute, [True]

    def commit_between(connection, query, *args, **kwargs):
        result = execute(connection, query, *args, **kwargs)
        text = str(query)
        if armed[0] and text.startswith("SELECT") and "FROM conversations WHERE id" in text and "FOR UPDATE" not in text:
            armed[0] = False
            other.commit_turn(after, 1)  # lands after the row was read, before the messages are
        return result

    monkeypatch.setattr(psycopg.Connection, "execute", commit_between)
    try:
        loaded = store.load("c1")
    finally:
        monkeypatch.undo()
        store.close()
        other.close()
    assert not armed[0]  # the other commit did land in between
    assert (loaded.tokens, loaded.messages) in [(before.tokens, before.messages), (after.tokens, after.messages)]
