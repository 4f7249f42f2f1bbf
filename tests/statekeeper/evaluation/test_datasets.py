from statekeeper.evaluation.datasets import _items, sharegpt_conversations


def test_truncated_json_stops_at_the_broken_tail():
    text = '[{"id": 1}, {"id": 2},\n {"id": 3, "conv'
    assert [item["id"] for item in _items(text)] == [1, 2]


def test_sharegpt_conversations_alternate_and_start_with_the_user():
    conversations = sharegpt_conversations(min_turns=4)
    for _ in range(20):
        conversation = next(conversations)
        roles = [role for role, _ in conversation]
        assert roles[0] == "user" and sum(r == "user" for r in roles) >= 4
        assert all(a != b for a, b in zip(roles, roles[1:]))
