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
