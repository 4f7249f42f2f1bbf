"""The history store contract (statekeeper/history/store.py), run against every backend: LMDB and a real
PostgreSQL (benchmarks/harness/postgres_server.py)."""

import threading

import pytest

from statekeeper.history import Conversation, HistoryConflict, StoredResponse


def test_roundtrip_and_delete(open_store):
    store = open_store()
    conversation = Conversation(id="s1", created_at="now", system="be brief", metadata={"k": 1},
                                messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                tokens=[1, 2, 3, 70000])
    store.save(conversation)
    store.close()
    store = open_store()
    loaded = store.load("s1")
    assert loaded == conversation and loaded.turns == 1
    assert loaded.chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert store.ids() == ["s1"]
    assert store.delete("s1") and store.load("s1") is None and not store.delete("s1")
    store.check_writable()
    assert store.ids() == []
    store.close()


def test_which_of_many_ids_exist_in_one_look(open_store):
    store = open_store()
    for session_id in ("a", "b", "c"):
        store.save(Conversation(id=session_id, created_at="now", system=None, metadata={}, messages=[], tokens=[]))
    store.delete("b")
    assert store.existing(["a", "b", "c", "never", "a"]) == {"a", "c"}
    assert store.existing([]) == set()
    store.close()


def _chat(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


def test_a_conversation_is_found_by_its_whole_history_and_only_that(open_store):
    store = open_store(b"k" * 32)
    conversation = Conversation(id="s1", created_at="now", system="be brief", found_by_messages=True,
                                messages=_chat("hi", "yo"))
    store.save(conversation)
    system = [{"role": "system", "content": "be brief"}]
    resent = system + _chat("hi", "yo", "and now?")
    assert store.find_heads(resent) == [("s1", 3)]  # its three messages are the resent history's first three
    assert store.find_heads(system + _chat("hi", "no", "and now?")) == []  # another reply: another history
    assert store.find_heads(_chat("hi", "yo", "and now?")) == []  # no system prompt: another history
    store.save(Conversation(id="s1", created_at="now", system="be brief", found_by_messages=True,
                            messages=_chat("hi", "yo", "and now?", "ok")))
    assert store.find_heads(resent) == []  # it moved on: its old head is gone
    moved_on = resent + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert store.find_heads(moved_on) == [("s1", 5)]
    assert store.delete("s1") and store.find_heads(moved_on) == []
    store.close()


def test_the_index_is_keyed_and_holds_only_conversations_found_by_their_messages(open_store):
    store = open_store(b"a" * 32)
    store.save(Conversation(id="s1", created_at="now", found_by_messages=True, messages=_chat("hi", "yo")))
    store.save(Conversation(id="fresh", created_at="now", found_by_messages=True))  # no reply yet: nothing to find
    store.save(Conversation(id="native", created_at="now", messages=_chat("hi", "yo")))  # /v1/sessions: by id only
    assert store.find_heads(_chat("hi", "yo", "x")) == [("s1", 2)]
    store.close()
    other = open_store(b"b" * 32, place="other")  # another key never finds it
    other.save(Conversation(id="s1", created_at="now", found_by_messages=True, messages=_chat("hi", "yo")))
    assert other.find_heads(_chat("hi", "yo", "x")) == [("s1", 2)]
    other.close()
    store = open_store(b"b" * 32)
    assert store.find_heads(_chat("hi", "yo", "x")) == []  # its entries were made with key a
    store.close()


def test_conversations_with_the_same_history_are_all_found_and_move_on_alone(open_store):
    """Two users who said the same and got the same greedy reply: both stay findable, and one moving on
    leaves the other where it was."""
    store = open_store(b"k" * 32)
    for name in ("a", "b"):
        store.save(Conversation(id=name, created_at="now", found_by_messages=True, messages=_chat("hi", "hello")))
    resent = _chat("hi", "hello", "how are you?")
    assert sorted(store.find_heads(resent)) == [("a", 2), ("b", 2)]
    store.save(Conversation(id="b", created_at="now", found_by_messages=True, messages=_chat("hi", "hello", "how are you?", "fine")))
    assert store.find_heads(resent) == [("a", 2)]
    assert store.find_heads(_chat("hi", "hello", "how are you?", "fine", "good")) == [("b", 4), ("a", 2)]
    store.close()


def _after_turn(conversation: Conversation, user: str, reply: str, tokens: list[int]) -> Conversation:
    return Conversation(**{**{name: getattr(conversation, name) for name in conversation.__slots__},
                           "messages": conversation.messages + _chat(user, reply), "tokens": conversation.tokens + tokens})


def test_client_text_and_token_ids_come_back_exactly(open_store):
    store = open_store()
    odd = "nul \x00, lone surrogate \ud800, emoji 🦊, quote \" and backslash \\"
    conversation = Conversation(id="odd-1", created_at="2025-01-01T00:00:00+00:00", system=odd,
                                metadata={"nested": {"list": [1, 2.5, None, True]}, "text": odd},
                                messages=_chat(odd, "yo"), tokens=[0, 1, 2**31 - 1, 70000],
                                compression={"policy": "none"}, tenant="acme", found_by_messages=True,
                                updated_at="2025-01-01T00:00:01+00:00")
    store.save(conversation)
    assert store.load("odd-1") == conversation and store.exists("odd-1") and not store.exists("missing")
    assert store.load("missing") is None


def test_a_turn_commits_only_onto_the_history_it_was_computed_from(open_store):
    store = open_store()
    start = Conversation(id="c1", created_at="now", messages=_chat("hi", "yo"), tokens=[1, 2])
    store.save(start)
    first = _after_turn(start, "more", "sure", [3, 4])
    second = _after_turn(start, "other", "fork", [5, 6])  # computed from the same start, elsewhere
    store.commit_turn(first, expected_turns=1)
    with pytest.raises(HistoryConflict, match="holds 2 turns, not the 1"):
        store.commit_turn(second, expected_turns=1)
    assert store.load("c1") == first  # nothing of the refused turn was written
    store.commit_turn(_after_turn(first, "and", "then", [7]), expected_turns=2)
    assert store.load("c1").turns == 3 and store.load("c1").tokens == [1, 2, 3, 4, 7]
    with pytest.raises(HistoryConflict, match="gone"):
        store.commit_turn(Conversation(id="never", created_at="now"), expected_turns=0)
    assert store.load("never") is None


def test_a_commit_with_an_older_fencing_token_is_refused(open_store):
    store = open_store()
    start = Conversation(id="c1", created_at="now")
    store.save(start)
    taken_over = _after_turn(start, "hi", "yo", [1])
    store.commit_turn(taken_over, expected_turns=0, fence=7)
    late = _after_turn(taken_over, "late", "stale", [2])
    with pytest.raises(HistoryConflict, match="fencing token 6"):
        store.commit_turn(late, expected_turns=1, fence=6)  # its lease expired; 7 took over
    store.commit_turn(late, expected_turns=1, fence=7)  # the holder of the newest lease goes on
    store.commit_turn(_after_turn(late, "a", "b", [3]), expected_turns=2, fence=None)  # no coordination
    assert store.load("c1").turns == 3
    store.save(store.load("c1"))  # a save leaves the newest fence as it was
    with pytest.raises(HistoryConflict):
        store.commit_turn(_after_turn(store.load("c1"), "c", "d", [4]), expected_turns=3, fence=6)


def test_concurrent_commits_of_one_turn_count_commit_once(open_store):
    """Replicas that raced from the same history: exactly one commit wins, the history never forks."""
    store = open_store()
    start = Conversation(id="c1", created_at="now")
    store.save(start)
    outcomes, barrier = [], threading.Barrier(8)

    def commit(i):
        barrier.wait()
        try:
            store.commit_turn(_after_turn(start, f"user {i}", f"reply {i}", [i]), expected_turns=0)
            outcomes.append(i)
        except HistoryConflict:
            pass

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 1
    (winner,) = outcomes
    assert store.load("c1").messages == _chat(f"user {winner}", f"reply {winner}")


def test_tenants_and_their_conversations(open_store):
    store = open_store()
    store.save_many([Conversation(id=f"a{i}", created_at="now", tenant="acme") for i in range(3)]
                    + [Conversation(id="d1", created_at="now")])
    assert (store.count("acme"), store.count(""), store.count("nobody")) == (3, 1, 0)
    assert sorted(store.tenant_ids("acme")) == ["a0", "a1", "a2"] and store.tenant_ids("nobody") == []
    assert sorted(store.tenants()) == ["", "acme"]
    store.delete("d1")
    assert store.tenants() == ["acme"] and store.count("") == 0


def test_save_many_is_all_or_none(open_store):
    store = open_store()
    with pytest.raises(Exception):  # noqa: B017 - the second record cannot be stored (no JSON for a set)
        store.save_many([Conversation(id="ok", created_at="now"),
                         Conversation(id="bad", created_at="now", metadata={"x": {1, 2}})])
    assert store.ids() == []


def test_pages_of_ids_by_prefix(open_store):
    store = open_store()
    store.save_many([Conversation(id=name, created_at="now") for name in ("a_1", "a_2", "a-3", "aX", "b1", "ab")])
    assert store.ids() == ["a-3", "aX", "a_1", "a_2", "ab", "b1"]  # byte order
    assert store.page("a_") == ["a_1", "a_2"]  # "_" is no wildcard
    assert store.page("a", limit=2) == ["a-3", "aX"]
    assert store.page("a", after="aX", limit=2) == ["a_1", "a_2"]
    assert store.page("", after="ab") == ["b1"] and store.page("zz") == []


def test_a_branch_is_found_at_the_longest_shared_prefix_that_ends_with_a_reply(open_store):
    store = open_store(b"k" * 32)
    store.save(Conversation(id="s1", created_at="now", found_by_messages=True,
                            messages=_chat("hi", "yo", "tell me more", "sure")))
    assert store.find_branch(_chat("hi", "yo", "tell me more", "sure", "x")) == (["s1"], 4)
    assert store.find_branch(_chat("hi", "yo", "something else")) == (["s1"], 2)  # an edited later turn
    assert store.find_branch(_chat("hi", "yo"), tenant="acme") == ([], 0)  # another tenant's index
    assert store.find_branch(_chat("other")) == ([], 0)
    store.delete("s1")
    assert store.find_branch(_chat("hi", "yo", "x")) == ([], 0)


def test_stored_responses(open_store):
    store = open_store()
    store.save(Conversation(id="c1", created_at="now", tenant="acme"))
    response = StoredResponse(id="resp_1", tenant="acme", conversation_id="c1", message_count=2,
                              body={"id": "resp_1", "output": [{"text": "nul \x00"}]})
    store.save_response(response)
    assert store.load_response("resp_1") == response and store.load_response("resp_2") is None
    assert store.delete_response("resp_1") and not store.delete_response("resp_1")
    assert store.load_response("resp_1") is None


def test_stored_responses_go_with_their_conversation(open_store):
    store = open_store()
    for conversation in ("c1", "c2"):
        store.save(Conversation(id=conversation, created_at="now", tenant="acme"))
    for number, conversation in enumerate(("c1", "c1", "c2")):
        store.save_response(StoredResponse(id=f"resp_{number}", tenant="acme", conversation_id=conversation,
                                           message_count=2, body={}))
    assert store.delete("c1")
    assert store.load_response("resp_0") is None and store.load_response("resp_1") is None
    assert store.load_response("resp_2") is not None
    assert not store.delete_response("resp_0")
    # A response stored after its conversation was deleted (the delete landed during the turn): nothing to
    # keep, as for any response of a deleted conversation; PostgreSQL's foreign key made it a 500
    store.save_response(StoredResponse(id="resp_3", tenant="acme", conversation_id="c1", message_count=2, body={}))
    assert store.load_response("resp_3") is None


def test_tool_calls_and_results_round_trip_and_index(open_store):
    """An agent's conversation (issue 30): an assistant message that is calls, the tool's result naming the
    call, the functions offered and the template's options, all stored and found again by exactly those
    messages."""
    store = open_store(b"k" * 32)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "{\"celsius\": 21}", "tool_call_id": "call_1"},
                {"role": "assistant", "content": "It is 21 degrees."}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = Conversation(id="agent", created_at="now", found_by_messages=True, messages=messages, tokens=[5],
                                tools=tools, template_options={"enable_thinking": False, "date_string": "26 Nov"})
    store.save(conversation)
    store.close()
    store = open_store(b"k" * 32)
    assert store.load("agent") == conversation
    assert store.find_heads(messages + [{"role": "user", "content": "And tomorrow?"}]) == [("agent", 4)]
    other_call = {**call, "function": {**call["function"], "arguments": "{\"city\": \"Rome\"}"}}
    edited = [messages[0], {**messages[1], "tool_calls": [other_call]}, *messages[2:]]
    assert store.find_heads(edited + [{"role": "user", "content": "And tomorrow?"}]) == []  # another call
    store.close()


def test_retention_settings_change_alone_and_survive_turns_and_reopening(open_store):
    store = open_store()
    conversation = Conversation(id="s1", created_at="now", messages=_chat("hi", "yo"), tokens=[1, 2],
                                retention={"pinned": True})
    store.save(conversation)
    assert store.load("s1").retention == {"pinned": True}
    assert store.set_retention("s1", {"priority": "high", "ttl_seconds": 3600})
    assert not store.set_retention("never", {"pinned": True})
    later = store.load("s1")
    assert later.retention == {"priority": "high", "ttl_seconds": 3600} and later.messages == conversation.messages
    store.commit_turn(Conversation(id="s1", created_at="now", messages=_chat("hi", "yo", "more", "ok"),
                                   tokens=[1, 2, 3, 4], retention=later.retention), expected_turns=1)
    store.close()
    reopened = open_store()
    assert reopened.load("s1").retention == {"priority": "high", "ttl_seconds": 3600}
    assert reopened.set_retention("s1", None) and reopened.load("s1").retention is None


def test_tenant_retention_defaults_are_replaced_removed_and_survive_reopening(open_store):
    store = open_store()
    assert store.tenant_retention() == {}
    store.set_tenant_retention("acme", {"pinned": True})
    store.set_tenant_retention("acme", {"priority": "low"})  # replaced, not merged
    store.set_tenant_retention("*", {"ttl_seconds": 600})
    store.set_tenant_retention("gone", None)  # removing what is not there is no error
    store.close()
    reopened = open_store()
    assert reopened.tenant_retention() == {"acme": {"priority": "low"}, "*": {"ttl_seconds": 600}}
    reopened.set_tenant_retention("*", None)
    assert reopened.tenant_retention() == {"acme": {"priority": "low"}}
    reopened.close()


def test_own_retention_lists_the_conversations_with_settings_by_tenant(open_store):
    store = open_store()
    for session_id, tenant, retention in (("a1", "acme", {"pinned": True}), ("a2", "acme", None),
                                          ("b1", "beta", {"ttl_seconds": 60})):
        store.save(Conversation(id=session_id, created_at="now", messages=_chat("hi", "yo"), tokens=[1, 2],
                                tenant=tenant, retention=retention))
    assert store.own_retention("acme") == {"a1": {"pinned": True}}
    assert store.own_retention("nobody") == {}
    assert store.own_retention() == {"a1": {"pinned": True}, "b1": {"ttl_seconds": 60}}
    store.set_retention("a1", None)
    assert store.own_retention() == {"b1": {"ttl_seconds": 60}}
    store.close()
