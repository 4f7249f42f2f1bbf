"""Two services over one PostgreSQL history: a conversation continues on either, token for token as if it
had stayed on one; a turn computed from a history that another replica moved on meanwhile is refused (409)
without writing anything; with the lease in Redis, one turn at a time on a conversation across replicas."""

import asyncio
import contextlib
import dataclasses
import time

import pytest

from statekeeper.config import LeaseConfig
from statekeeper.sessions import SessionError, TurnRequest


async def _turn(service, session, content, max_tokens=6):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?"]


def _pair(make_service, postgres_dsn, tmp_path):
    """Two replicas over one PostgreSQL history, each with a DRAM tier of its own."""
    return [make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / name) for name in "ab"]


def test_a_conversation_started_on_one_replica_continues_on_the_other(make_service, postgres_dsn, tmp_path):
    a, b = _pair(make_service, postgres_dsn, tmp_path)
    alone = make_service(tiers=("dram",), data_dir=tmp_path / "alone")  # LMDB, one process, never moved

    async def scenario():
        shared, reference = (await a.create("Be brief.", None)).id, (await alone.create("Be brief.", None)).id
        replies = []
        for turn, content in enumerate(TURNS):
            here = (a, b, a)[turn]  # A, then B, then back to A (whose KV in memory is stale by then)
            result = await _turn(here, shared, content)
            expected = await _turn(alone, reference, content)
            replies.append((result.content, result.prompt_tokens, result.completion_tokens))
            assert replies[-1] == (expected.content, expected.prompt_tokens, expected.completion_tokens)
        stored = a.history.load(shared)
        assert stored.tokens == alone.history.load(reference).tokens and stored.turns == 3

    asyncio.run(scenario())


def test_a_turn_on_a_history_moved_on_elsewhere_is_refused_and_writes_nothing(make_service, postgres_dsn, tmp_path,
                                                                             monkeypatch):
    a, b = _pair(make_service, postgres_dsn, tmp_path)
    commit = b.history.commit_turn

    def another_replica_commits_first(conversation, expected_turns, fence=None):
        """While B's turn ran, another replica (no lease here) committed its own turn onto the same history."""
        stored = a.history.load(conversation.id)
        moved_on = dataclasses.replace(stored, messages=stored.messages + [
            {"role": "user", "content": "elsewhere"}, {"role": "assistant", "content": "meanwhile"}])
        a.history.commit_turn(moved_on, expected_turns)
        return commit(conversation, expected_turns, fence)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        monkeypatch.setattr(b.history, "commit_turn", another_replica_commits_first)
        with pytest.raises(SessionError) as refused:
            await _turn(b, session, TURNS[1])
        assert refused.value.status == 409 and "another turn was committed" in str(refused.value)
        stored = a.history.load(session)
        assert [m["content"] for m in stored.messages if m["role"] == "user"] == [TURNS[0], "elsewhere"]
        held = b.in_memory(session)  # B follows the stored history at once; its KV of the old one is dropped
        assert held.conversation.messages == stored.messages and held.cache is None
        monkeypatch.setattr(b.history, "commit_turn", commit)
        again = await _turn(b, session, TURNS[1])  # asking again continues the stored history
        assert again.prompt_tokens > len(stored.tokens) and b.history.load(session).turns == 3

    asyncio.run(scenario())


def test_a_turn_whose_conversation_another_replica_deleted_meanwhile_is_not_found_and_forgotten(
        make_service, postgres_dsn, tmp_path, monkeypatch):
    """While B's turn ran, A deleted the conversation: B's commit is refused; B answers 404 (not a 409 that
    asks the client to try again) and holds nothing of it (not even until its next sweep)."""
    a, b = _pair(make_service, postgres_dsn, tmp_path)
    commit = b.history.commit_turn

    def deleted_elsewhere_first(conversation, expected_turns, fence=None):
        a.history.delete(conversation.id)
        return commit(conversation, expected_turns, fence)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(b, session, TURNS[0])
        monkeypatch.setattr(b.history, "commit_turn", deleted_elsewhere_first)
        with pytest.raises(SessionError) as refused:
            await _turn(b, session, TURNS[1])
        assert refused.value.status == 404 and b.in_memory(session) is None
        assert b.stats()["active_kv_bytes"] == 0

    asyncio.run(scenario())


def test_scoring_after_another_replicas_turn_scores_the_stored_history(make_service, postgres_dsn, tmp_path):
    """A scored messages appended to the history as it held it before B's turn: the slot took the stored one
    only after the tokens were built, so A scored the old history and then kept a KV short of the new one."""
    a, b = _pair(make_service, postgres_dsn, tmp_path)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        await _turn(b, session, TURNS[1])  # the conversation moves on elsewhere
        here, there = await a.score(session, messages), await b.score(session, messages)
        assert [(t.token, t.greedy_token) for t in here.tokens] == [(t.token, t.greedy_token) for t in there.tokens]
        assert a.in_memory(session).cache.num_tokens >= len(b.history.load(session).tokens) - 1

    asyncio.run(scenario())


def _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, **lease_options):
    lease = LeaseConfig(redis_server.url, key_prefix=redis_prefix, **lease_options)
    return [make_service(tiers=("dram",), history_dsn=postgres_dsn, lease=lease, data_dir=tmp_path / name)
            for name in ("a", "b")]


def _slowed_commit(service, monkeypatch, seconds):
    commit = service.history.commit_turn

    def slow(*args):
        time.sleep(seconds)
        return commit(*args)

    monkeypatch.setattr(service.history, "commit_turn", slow)


def _sharing_redis(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, **options):
    """Two replicas over one PostgreSQL history that share Redis as their KV tier (and its lease): one blob
    secret and one index secret, as deployed replicas have (STATEKEEPER_BLOB_SECRET, INDEX_SECRET)."""
    lease = LeaseConfig(redis_server.url, key_prefix=redis_prefix)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "blob-secret").write_bytes(b"shared-blob-secret-0123456789abcd")
        (tmp_path / name / "index-secret").write_bytes(b"i" * 32)
    return [make_service(tiers=("dram", "redis"), history_dsn=postgres_dsn, lease=lease, data_dir=tmp_path / name,
                         **options) for name in ("a", "b")]


async def _b_waits_for_as_turn(a, b, before_b=None, after_s: float = 0.4) -> None:
    """A's turn holds the lease; `after_s` into it (after `before_b()`, if given) B's turn waits for it, then
    continues what A committed: both turns in the history, one after the other."""
    session = (await a.create(None, None)).id
    on_a = asyncio.create_task(_turn(a, session, TURNS[0]))
    await asyncio.sleep(after_s)
    busy = None if before_b is None else before_b()
    await _turn(b, session, TURNS[1])
    await on_a
    if busy is not None:
        await busy
    stored = b.history.load(session)
    assert [m["content"] for m in stored.messages if m["role"] == "user"] == TURNS[:2]


def test_a_retention_set_on_one_replica_during_a_turn_on_the_other_is_not_written_back(
        make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, monkeypatch):
    """A turn's commit writes every field of the conversation, its retention as the turn found it: a retention
    set through B while A's turn ran was written back to the old one by A's commit. B's write waits for the
    conversation's lease, as a turn's does."""
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, wait_seconds=5.0)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        _slowed_commit(a, monkeypatch, 0.5)
        on_a = asyncio.create_task(_turn(a, session, TURNS[1]))
        await asyncio.sleep(0.2)  # A's turn holds the lease
        await b.set_retention(session, {"pinned": True})
        await on_a
        assert a.history.load(session).retention == {"pinned": True}

    asyncio.run(scenario())


def test_a_turn_leased_elsewhere_waits_briefly_then_is_refused(make_service, postgres_dsn, redis_server, redis_prefix,
                                                               tmp_path, monkeypatch):
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, wait_seconds=0.2)

    async def scenario():
        session = (await a.create(None, None)).id
        _slowed_commit(a, monkeypatch, 1.0)  # A's turn holds the lease for a second
        on_a = asyncio.create_task(_turn(a, session, TURNS[0]))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(SessionError) as refused:
            await _turn(b, session, TURNS[1])
        assert refused.value.status == 409 and "another replica" in str(refused.value)
        assert 0.2 <= time.monotonic() - started < 1.0  # it waited for the lease, briefly
        await on_a
        b.replicas.leases.wait_seconds = 5.0
        _slowed_commit(a, monkeypatch, 0.5)
        on_a = asyncio.create_task(_turn(a, session, TURNS[1]))
        await asyncio.sleep(0.2)
        await _turn(b, session, TURNS[2])  # waits for A's turn, then continues what A committed
        await on_a
        stored = b.history.load(session)
        assert [m["content"] for m in stored.messages if m["role"] == "user"] == TURNS and stored.turns == 3

    asyncio.run(scenario())


def test_a_replica_that_lost_its_lease_mid_turn_cannot_commit_over_the_next_holder(
        make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, monkeypatch):
    """A stalls past its lease (its renewals stop, as a paused or partitioned process's do); B is granted
    the lease, runs and commits its turn; A's late commit is refused and the history does not fork."""
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, ttl_ms=200, wait_seconds=3.0)
    monkeypatch.setattr(a.replicas.leases, "renew", lambda lease: True)  # A believes it still holds it
    _slowed_commit(a, monkeypatch, 1.0)

    async def scenario():
        session = (await a.create(None, None)).id
        on_a = asyncio.create_task(_turn(a, session, TURNS[0]))
        await asyncio.sleep(0.1)
        on_b = await _turn(b, session, TURNS[1])  # granted once A's lease expired
        with pytest.raises(SessionError) as refused:
            await on_a
        assert refused.value.status == 409
        stored = b.history.load(session)
        assert [m["content"] for m in stored.messages if m["role"] == "user"] == [TURNS[1]]
        assert stored.messages[-1]["content"] == on_b.content
        await _turn(a, session, TURNS[2])  # A asks again: it follows the stored history
        assert [m["content"] for m in b.history.load(session).messages if m["role"] == "user"] == TURNS[1:]

    asyncio.run(scenario())


def test_the_other_replica_restores_the_kv_from_the_shared_redis_tier(make_service, postgres_dsn, redis_server,
                                                                      redis_prefix, tmp_path):
    """Going inactive on A stores the KV in the Redis tier the replicas share; B, which never held it, runs
    the next turn from it (restore source redis, the reply as if nothing moved), not from a recompute."""
    lease = LeaseConfig(redis_server.url, key_prefix=redis_prefix)
    for name in ("a", "b"):  # replicas sharing a Redis share its blob secret (STATEKEEPER_BLOB_SECRET)
        (tmp_path / name).mkdir()
        (tmp_path / name / "blob-secret").write_bytes(b"shared-blob-secret-0123456789abcd")
    a, b = [make_service(tiers=("dram", "redis"), history_dsn=postgres_dsn, lease=lease, data_dir=tmp_path / name)
            for name in ("a", "b")]
    alone = make_service(tiers=("dram",), data_dir=tmp_path / "alone")

    async def scenario():
        shared, reference = (await a.create("Be brief.", None)).id, (await alone.create("Be brief.", None)).id
        for service, session in ((a, shared), (alone, reference)):
            await _turn(service, session, TURNS[0])
        await a.offload(shared)
        assert a.tiers.locate(shared) == "redis"
        moved, stayed = await _turn(b, shared, TURNS[1]), await _turn(alone, reference, TURNS[1])
        assert moved.restore_source == "redis" and moved.cached_tokens > 0
        assert (moved.content, moved.prompt_tokens) == (stayed.content, stayed.prompt_tokens)

    asyncio.run(scenario())


def test_a_conversation_deleted_on_one_replica_leaves_the_others_memory_at_its_next_sweep(make_service, postgres_dsn,
                                                                                         tmp_path):
    """B holds the conversation's KV after a turn there; A deletes it. B's next sweep frees that KV and forgets
    the conversation without waiting for it to go idle (nobody would ever ask B for it again), while a
    conversation that still exists keeps its KV."""
    a, b = _pair(make_service, postgres_dsn, tmp_path)

    async def scenario():
        deleted, kept = (await a.create(None, None)).id, (await a.create(None, None)).id
        for session in (deleted, kept):
            await _turn(b, session, TURNS[0])
        assert b.stats()["active_sessions"] == 2
        kept_bytes = b.stats()["active_kv_bytes"] // 2
        await a.delete(deleted)
        await b.sweep()
        stats = b.stats()
        assert (stats["sessions_in_memory"], stats["active_sessions"]) == (1, 1)
        assert 0 < stats["active_kv_bytes"] <= 2 * kept_bytes
        assert (await _turn(b, kept, TURNS[1])).cached_tokens > 0
        with pytest.raises(SessionError) as gone:
            await _turn(b, deleted, TURNS[1])
        assert gone.value.status == 404

    asyncio.run(scenario())


def test_a_conversations_retention_set_on_one_replica_outlives_a_turn_on_the_other(make_service, postgres_dsn,
                                                                                    tmp_path):
    """A held the conversation in memory; its retention set through B reached the history only. A's next turn
    kept A's copy (same tokens and messages) and its commit wrote the old retention back: the pin was lost."""
    a, b = _pair(make_service, postgres_dsn, tmp_path)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        await b.set_retention(session, {"pinned": True})
        result = await _turn(a, session, TURNS[1])
        assert result.restore_source == "active"  # the KV in memory still fits: kept
        assert a.history.load(session).retention == {"pinned": True}
        assert (await a.view(session)).retention["pinned"] is True

    asyncio.run(scenario())


def test_a_tenants_retention_set_on_one_replica_applies_on_the_other_at_its_next_sweep(make_service, postgres_dsn,
                                                                                      tmp_path):
    a, b = _pair(make_service, postgres_dsn, tmp_path)

    async def scenario():
        session = (await b.create(None, None)).id
        await _turn(b, session, TURNS[0])
        await b.offload(session)
        await a.set_tenant_retention("*", {"pinned": True, "priority": "high"})
        assert (await b.view(session)).retention["pinned"] is False  # not before its sweep
        await b.sweep()
        assert (await b.view(session)).retention == {"pinned": True, "priority": "high", "ttl_seconds": None}

    asyncio.run(scenario())


def test_with_the_shared_tier_down_going_inactive_keeps_the_kv_in_this_replicas_tiers(make_service, postgres_dsn,
                                                                                        tmp_path):
    """Replicas sharing the history store a conversation going inactive in Redis, so that any of them restores
    it; with Redis down that put failed and the KV was dropped though DRAM had room."""
    from benchmarks.harness.redis_server import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    service = make_service(tiers=("dram", "redis"), redis_url=server.url, history_dsn=postgres_dsn,
                           data_dir=tmp_path / "a")

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, "Hello, how are you today?")
        await service.offload(session)
        assert (await service.view(session)).tier == "redis"
        await asyncio.to_thread(server.kill)
        await _turn(service, session, "Tell me about Rome.")
        await service.offload(session)
        assert (await service.view(session)).tier == "dram"
        assert (await _turn(service, session, "And Carthage?")).restore_source == "dram"

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_conversations_kv_in_the_shared_tier_stays_there_compressed_and_when_read(make_service, postgres_dsn,
                                                                                     tmp_path):
    """Compressing it put the compressed blob in the fastest tier (this replica's DRAM) and deleted the one in
    Redis; opening the conversation (GET messages) or prefetching it (POST .../prefetch) promoted it the same
    way: another replica's next turn then recomputed it."""
    from benchmarks.harness.redis_server import RedisServer
    from statekeeper.config import CompressionConfig

    server = RedisServer(tmp_path / "redis").start()
    options = dict(tiers=("dram", "redis"), redis_url=server.url, history_dsn=postgres_dsn,
                   compression=CompressionConfig(policy="heads", scorer="expected", keep=0.5, codec="int4"),
                   compress_after_seconds=0, compress_quiet_seconds=0)
    for replica in ("a", "b"):  # replicas sharing Redis share its blob secret (REDIS tier's secret)
        (tmp_path / replica).mkdir()
        (tmp_path / replica / "blob-secret").write_bytes(b"s" * 32)
    a = make_service(data_dir=tmp_path / "a", **options)
    b = make_service(data_dir=tmp_path / "b", **options)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        await a.offload(session)
        await a.compress_due()
        view = await a.view(session)
        assert view.is_compressed and view.tier == "redis"
        await a.messages(session)  # a promotion, if any, runs in the background
        await asyncio.sleep(0.5)
        assert (await a.view(session)).tier == "redis"
        assert (await a.prefetch(session)).tier == "redis"  # a client's prefetch: the same
        assert (await _turn(b, session, TURNS[1])).restore_source == "redis"

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_compression_of_a_state_another_replica_moved_on_meanwhile_is_dropped(make_service, postgres_dsn,
                                                                                tmp_path):
    """A compresses the conversation's exact blob in Redis; meanwhile B runs the next turn and stores its newer
    exact state there. A's compressed blob of the older state went over B's: the next turn restored a shorter,
    lossy prefix and B's books said exact. The compression is dropped; B's state stays as stored."""
    import threading

    from benchmarks.harness.redis_server import RedisServer
    from statekeeper.config import CompressionConfig

    server = RedisServer(tmp_path / "redis").start()
    options = dict(tiers=("dram", "redis"), redis_url=server.url, history_dsn=postgres_dsn,
                   compression=CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4"),
                   compress_after_seconds=0, compress_quiet_seconds=0)
    for replica in ("a", "b"):
        (tmp_path / replica).mkdir()
        (tmp_path / replica / "blob-secret").write_bytes(b"s" * 32)
    a = make_service(data_dir=tmp_path / "a", **options)
    b = make_service(data_dir=tmp_path / "b", **options)
    scoring, resume = threading.Event(), threading.Event()
    step = a.worker.reconstruction_step

    def held_step(*args):  # A's compression scores the state, and waits while B moves the conversation on
        scoring.set()
        resume.wait(30)
        return step(*args)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0] * 8)
        await a.offload(session)
        assert a.tiers.locate(session) == "redis"
        a.worker.reconstruction_step = held_step
        try:
            compressing = asyncio.ensure_future(a.compress_due())
            await asyncio.to_thread(scoring.wait, 30)
            a.worker.reconstruction_step = step  # B's own work scores nothing; A's job holds its step already
            await _turn(b, session, TURNS[1])
            await b.offload(session)
            resume.set()
            await compressing
        finally:
            a.worker.reconstruction_step = step
            resume.set()
        stored = b.history.load(session)
        view = await b.view(session)
        assert view.tier == "redis" and not view.is_compressed and view.tokens == len(stored.tokens)
        result = await _turn(b, session, TURNS[2])
        # B's whole state (the reply's last token has no KV until it is fed), not A's shorter compressed one
        assert result.restore_source == "redis" and result.cached_tokens == len(stored.tokens) - 1

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_resent_conversation_hinting_at_one_another_replica_deleted_starts_a_new_one(make_service, postgres_dsn,
                                                                                     tmp_path):
    """The hint (X-Statekeeper-Conversation, prompt_cache_key) named a conversation A held and B had deleted:
    A's look at the stored one found it gone and the request failed with a 404 until A's sweep, where one
    replica alone starts a new conversation."""
    a, b = _pair(make_service, postgres_dsn, tmp_path)

    async def scenario():
        old = (await a.create(None, None)).id  # held in A's memory
        await b.delete(old)
        session, _, events = await a.chat([{"role": "user", "content": "Hi"}], TurnRequest("", max_tokens=3), hint=old)
        async for _ in events:
            pass
        assert session != old and a.history.load(session).turns == 1

    asyncio.run(scenario())


def test_two_replicas_that_found_one_conversation_by_the_same_resent_history_do_not_both_extend_it(
        make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, monkeypatch):
    """Two requests resend the same history with a new message (a retry, two forks of one response) to two
    replicas: both find the stored conversation by its messages. The second used to wait for the first's lease
    and append its message to the history the first had moved on: the message twice, and the other request's
    reply in its context. A turn runs only on the history it was matched to; the other request branches."""
    for name in ("a", "b"):  # one index secret (STATEKEEPER_INDEX_SECRET), or neither finds the other's
        (tmp_path / name).mkdir()
        (tmp_path / name / "index-secret").write_bytes(b"i" * 32)
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, wait_seconds=5.0)
    options = TurnRequest("", max_tokens=4)

    async def ask(service, messages):
        session, _, events = await service.chat(messages, options)
        async for _ in events:
            pass
        return session

    async def scenario():
        first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TURNS[0]}]
        seeded = await ask(a, first)
        resent = a.history.load(seeded).chat_messages() + [{"role": "user", "content": TURNS[1]}]
        _slowed_commit(a, monkeypatch, 0.5)
        on_a = asyncio.create_task(ask(a, resent))
        await asyncio.sleep(0.2)  # A's turn holds the lease, its commit not yet made
        sessions = [await ask(b, resent), await on_a]
        assert len(set(sessions)) == 2 and seeded in sessions
        for session in sessions:
            asked = [m["content"] for m in a.history.load(session).messages if m["role"] == "user"]
            assert asked == [TURNS[0], TURNS[1]]

    asyncio.run(scenario())


def test_a_turn_whose_client_left_gives_its_lease_back_at_once(make_service, postgres_dsn, redis_server, redis_prefix,
                                                               tmp_path, monkeypatch):
    """A client's disconnect under uvicorn cancels the request's task again at each await (anyio's cancel scope):
    the lease's release after the turn was cancelled too, and the conversation stayed leased to no turn until
    the lease expired, every other replica's turn on it waiting or refused meanwhile."""
    import anyio

    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, ttl_ms=30_000,
                     wait_seconds=0.5)
    step = a.worker.step
    monkeypatch.setattr(a.worker, "step", lambda *args: time.sleep(0.02) or step(*args))

    async def scenario():
        session = (await a.create(None, None)).id
        async with anyio.create_task_group() as group:
            group.start_soon(_turn, a, session, TURNS[0], 200)
            await asyncio.sleep(0.3)  # the turn holds the lease, its reply under way
            group.cancel_scope.cancel()  # the client left
        monkeypatch.setattr(a.worker, "step", step)
        await _turn(b, session, TURNS[1])  # not refused: nothing holds the lease

    asyncio.run(scenario())


def test_a_replica_whose_view_is_behind_leaves_the_newer_shared_blob_in_redis(make_service, postgres_dsn,
                                                                              redis_server, redis_prefix, tmp_path):
    """A holds a conversation as it was two turns ago; B ran the next turn and stored its state in Redis. A
    client edits that turn on A, which branches from the conversation and reads its blob against the history A
    holds: the blob, another state than that, was deleted from Redis for every replica as if corrupt, and B's
    next turn recomputed the whole history."""
    a, b = _sharing_redis(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path)
    options = TurnRequest("", max_tokens=4)

    async def ask(service, messages):
        session, _, events = await service.chat(messages, options)
        async for _ in events:
            pass
        return session

    async def scenario():
        session = await ask(a, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TURNS[0]}])
        second = a.history.load(session).chat_messages() + [{"role": "user", "content": TURNS[1]}]
        assert await ask(a, second) == session
        await a.offload(session)
        third = b.history.load(session).chat_messages() + [{"role": "user", "content": TURNS[2]}]
        assert await ask(b, third) == session
        await b.offload(session)
        assert b.tiers.locate(session) == "redis"
        edited = third[:-1] + [{"role": "user", "content": "Something else entirely."}]
        assert await ask(a, edited) != session  # a branch of it, read from A's view of it
        result = await _turn(b, session, "And then?")
        assert result.restore_source == "redis" and result.cached_tokens > 0

    asyncio.run(scenario())


def _a_ttl_clock(a) -> list[float]:
    """Gives A's placement policy a clock the test moves (B's stays the real one)."""
    now = [1_000_000.0]
    a.placement_policy.clock = lambda: now[0]
    return now


async def _stored_on_a_with_a_ttl(a) -> str:
    """A conversation with a 60-second TTL whose first turn ran on A and was stored (in Redis)."""
    session = (await a.create(None, None, retention={"ttl_seconds": 60})).id
    await _turn(a, session, TURNS[0])
    await a.offload(session)
    return session


def test_a_ttl_counted_on_one_replica_leaves_the_state_a_later_turn_on_another_stored(make_service, postgres_dsn,
                                                                                      redis_server, redis_prefix,
                                                                                      tmp_path):
    """A replica's TTL clock restarts at its own turns only: A's expiry, 60 s after A's turn, deleted from Redis
    the state B had stored after its turn 10 s before, and B's next turn recomputed the whole history. The TTL
    runs from the conversation's last turn, wherever it ran."""
    a, b = _sharing_redis(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path)
    now = _a_ttl_clock(a)

    async def scenario():
        session = await _stored_on_a_with_a_ttl(a)
        now[0] += 50
        await _turn(b, session, TURNS[1])
        await b.offload(session)
        now[0] += 11
        await a.retention.expire()
        result = await _turn(b, session, TURNS[2])
        assert result.restore_source in ("dram", "redis") and result.cached_tokens > 0

    asyncio.run(scenario())


def test_an_idle_offload_of_a_state_another_replica_moved_on_leaves_the_newer_blob(make_service, postgres_dsn,
                                                                                   redis_server, redis_prefix,
                                                                                   tmp_path):
    """A kept a conversation's KV in memory after its turn; B ran the next turn and stored its state in Redis.
    A's idle offload then wrote its older state over it, and the next turn recomputed B's turn."""
    a, b = _sharing_redis(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, idle_offload_seconds=0)

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        assert a.in_memory(session).cache is not None  # held until A's sweep
        await _turn(b, session, TURNS[1])
        await b.offload(session)
        await a.sweep()  # idle: A stores what it holds
        history = b.history.load(session).tokens
        result = await _turn(b, session, TURNS[2])
        # B's whole state: all but the reply's last token, which no forward has fed yet
        assert result.restore_source == "redis" and result.cached_tokens == len(history) - 1

    asyncio.run(scenario())


def test_a_lease_renewal_that_cannot_reach_redis_once_is_tried_again(make_service, postgres_dsn, redis_server,
                                                                     redis_prefix, tmp_path, monkeypatch):
    """One renewal that could not reach Redis (a failover, a blip) ended the renewals for the rest of the turn:
    the lease expired under it, another replica's turn ran at the same time, and one of the two computed a
    whole reply for a 409. Renewals go on while the lease may still hold; the other turn waits its turn."""
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, ttl_ms=300, wait_seconds=5.0)
    renew, failures = a.replicas.leases.renew, []

    def unreachable_once(lease):
        if not failures:
            failures.append(lease)
            return None  # Redis could not be reached
        return renew(lease)

    monkeypatch.setattr(a.replicas.leases, "renew", unreachable_once)

    _slowed_commit(a, monkeypatch, 1.0)  # A's turn holds the lease for a second, past three TTLs
    asyncio.run(_b_waits_for_as_turn(a, b))
    assert failures


def test_a_lease_is_renewed_while_the_io_threads_are_busy_with_blobs(make_service, postgres_dsn, redis_server,
                                                                      redis_prefix, tmp_path, monkeypatch):
    """The renewals ran on the two I/O threads every blob read and write uses: behind seconds of blob writes
    they came too late, the lease expired under its turn, and another replica's turn ran at the same time."""
    a, b = _replicas(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path, ttl_ms=300, wait_seconds=5.0)

    _slowed_commit(a, monkeypatch, 0.3)
    blob_writes = lambda: asyncio.gather(*(a.in_io_thread(time.sleep, 1.2) for _ in range(2)))  # noqa: E731
    asyncio.run(_b_waits_for_as_turn(a, b, blob_writes, after_s=0.1))


def test_a_tenants_conversation_limit_holds_across_replicas_creating_at_once(make_service, postgres_dsn, tmp_path,
                                                                              monkeypatch):
    """Each replica counted the tenant's conversations, then saved its new one, under a lock of its own: two
    replicas creating at once both counted one under the limit and both saved, one over it."""
    import threading

    from statekeeper.sessions import TenantLimitReached
    from statekeeper.tenancy import TenantLimits

    a, b = [make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / name,
                         tenant_limits=TenantLimits(sessions=1)) for name in "ab"]
    both_counting = threading.Barrier(2, timeout=2)

    def counting_at_once(service):
        count = service.history.count

        def counted(tenant):
            found = count(tenant)
            with contextlib.suppress(threading.BrokenBarrierError):
                both_counting.wait()  # each has counted before either saves (where the counts are apart)
            return found

        monkeypatch.setattr(service.history, "count", counted)

    for service in (a, b):
        counting_at_once(service)

    async def scenario():
        created = await asyncio.gather(a.create(None, None, tenant="acme"), b.create(None, None, tenant="acme"),
                                       return_exceptions=True)
        assert sum(isinstance(result, TenantLimitReached) for result in created) == 1
        assert a.history.count("acme") == 1

    asyncio.run(scenario())


def test_with_the_history_down_going_inactive_still_stores_the_kv(make_service, postgres_dsn, redis_server,
                                                                  redis_prefix, tmp_path, monkeypatch):
    """Before storing, a replica asks the shared history whether another one moved the conversation on: while
    the history could not answer, every idle conversation's KV was dropped instead of stored (and shutdown
    stored nothing before its deadline)."""
    from statekeeper.history import HistoryUnavailable

    lease = LeaseConfig(redis_server.url, key_prefix=redis_prefix)
    a = make_service(tiers=("dram", "redis"), history_dsn=postgres_dsn, lease=lease, data_dir=tmp_path / "a",
                     idle_offload_seconds=0)

    def down(session_id):
        raise HistoryUnavailable("the history database cannot be reached")

    async def scenario():
        session = (await a.create(None, None)).id
        await _turn(a, session, TURNS[0])
        monkeypatch.setattr(a.history, "load", down)
        await a.sweep()  # idle: stored
        assert a.in_memory(session) is None or a.in_memory(session).cache is None
        assert a.tiers.locate(session) == "redis"

    asyncio.run(scenario())


def test_a_ttl_removed_on_another_replica_keeps_the_stored_state(make_service, postgres_dsn, redis_server,
                                                                 redis_prefix, tmp_path):
    """B removed the conversation's TTL; A's policy, told nothing, still counted the old one and deleted the
    state from Redis when it ran out, though the history A read said there was no TTL any more."""
    a, b = _sharing_redis(make_service, postgres_dsn, redis_server, redis_prefix, tmp_path)
    now = _a_ttl_clock(a)

    async def scenario():
        session = await _stored_on_a_with_a_ttl(a)
        await b.set_retention(session, {})
        now[0] += 61
        await a.retention.expire()
        result = await _turn(b, session, TURNS[1])
        assert result.restore_source == "redis" and result.cached_tokens > 0

    asyncio.run(scenario())
