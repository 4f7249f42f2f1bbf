from statekeeper.history import Conversation, HistoryStore


def test_roundtrip_and_delete(tmp_path):
    store = HistoryStore(tmp_path / "h.lmdb")
    conversation = Conversation(id="s1", created_at="now", system="be brief", metadata={"k": 1},
                                messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                tokens=[1, 2, 3, 70000])
    store.save(conversation)
    store.close()
    store = HistoryStore(tmp_path / "h.lmdb")
    loaded = store.load("s1")
    assert loaded == conversation and loaded.turns == 1
    assert loaded.chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert store.ids() == ["s1"]
    assert store.delete("s1") and store.load("s1") is None and not store.delete("s1")
    store.check_writable()
    assert store.ids() == []
    store.close()


def _chat(*texts: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


def test_a_conversation_is_found_by_its_whole_history_and_only_that(tmp_path):
    store = HistoryStore(tmp_path / "h.lmdb", index_key=b"k" * 32)
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


def test_the_index_is_keyed_and_holds_only_conversations_found_by_their_messages(tmp_path):
    store = HistoryStore(tmp_path / "h.lmdb", index_key=b"a" * 32)
    store.save(Conversation(id="s1", created_at="now", found_by_messages=True, messages=_chat("hi", "yo")))
    store.save(Conversation(id="fresh", created_at="now", found_by_messages=True))  # no reply yet: nothing to find
    store.save(Conversation(id="native", created_at="now", messages=_chat("hi", "yo")))  # /v1/sessions: by id only
    assert store.find_heads(_chat("hi", "yo", "x")) == [("s1", 2)]
    store.close()
    other = HistoryStore(tmp_path / "other.lmdb", index_key=b"b" * 32)  # another key never finds it
    other.save(Conversation(id="s1", created_at="now", found_by_messages=True, messages=_chat("hi", "yo")))
    assert other.find_heads(_chat("hi", "yo", "x")) == [("s1", 2)]
    other.close()
    store = HistoryStore(tmp_path / "h.lmdb", index_key=b"b" * 32)
    assert store.find_heads(_chat("hi", "yo", "x")) == []  # its entries were made with key a
    store.close()


def test_conversations_with_the_same_history_are_all_found_and_move_on_alone(tmp_path):
    """Two users who said the same and got the same greedy reply: both stay findable, and one moving on
    leaves the other where it was."""
    store = HistoryStore(tmp_path / "h.lmdb", index_key=b"k" * 32)
    for name in ("a", "b"):
        store.save(Conversation(id=name, created_at="now", found_by_messages=True, messages=_chat("hi", "hello")))
    resent = _chat("hi", "hello", "how are you?")
    assert sorted(store.find_heads(resent)) == [("a", 2), ("b", 2)]
    store.save(Conversation(id="b", created_at="now", found_by_messages=True, messages=_chat("hi", "hello", "how are you?", "fine")))
    assert store.find_heads(resent) == [("a", 2)]
    assert store.find_heads(_chat("hi", "hello", "how are you?", "fine", "good")) == [("b", 4), ("a", 2)]
    store.close()
