"""Two services over one PostgreSQL history (replicas without a lease yet): a conversation continues on
either, token for token as if it had stayed on one, and a turn computed from a history that another
replica has moved on meanwhile is refused (409) without writing anything."""

import asyncio
import dataclasses

import pytest

from statekeeper.sessions import SessionError, TurnRequest


async def _turn(service, session, content, max_tokens=6):
    async for event in service.turn(session, TurnRequest(content, max_tokens=max_tokens)):
        pass
    return event


TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?"]


def test_a_conversation_started_on_one_replica_continues_on_the_other(make_service, postgres_dsn, tmp_path):
    a = make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / "a")
    b = make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / "b")
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
    a = make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / "a")
    b = make_service(tiers=("dram",), history_dsn=postgres_dsn, data_dir=tmp_path / "b")
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
        monkeypatch.setattr(b.history, "commit_turn", commit)
        again = await _turn(b, session, TURNS[1])  # asking again continues the stored history
        assert again.prompt_tokens > len(stored.tokens) and b.history.load(session).turns == 3

    asyncio.run(scenario())
