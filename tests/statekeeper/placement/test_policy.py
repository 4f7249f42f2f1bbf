"""The expected-value policy inside the real TierManager: what it moves out, what it compresses."""

import pytest

from statekeeper.placement.costs import CostProfile
from statekeeper.placement.policy import SOON_S, LruPlacement, ValuePolicy
from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager
from storage.policy import LruPolicy

HOUR = 3_600.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def trained_policy(clock: Clock, tier_names: tuple[str, ...] = ("dram",)) -> ValuePolicy:
    """Seen 500 times each: the agent's users come back after 20 s or never (100 of them), the chat's after
    40 minutes."""
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), list(tier_names), clock=clock)
    for number in range(500):
        for tenant, gap in (("agent", 20.0), ("chat", 2_400.0)):
            key = f"{tenant}-{number}"
            policy.went_idle(key, tenant, 1, 10, now=number * 10.0)
            if tenant == "chat" or number >= 100:
                policy.turn_started(key, now=number * 10.0 + gap)
    clock.now = 72 * HOUR  # the agent's users who never came back have been away three days
    return policy


def fill(manager: TierManager, policy, clock: Clock) -> None:
    """A chat conversation idle 20 minutes and an agent's idle 10, stored in that order, then a third that
    needs one of their places (40-byte blobs, a 100-byte tier)."""
    for key, tenant, idle in (("old-chat", "chat", 1_200.0), ("new-agent", "agent", 600.0), ("third", "chat", 0.0)):
        if isinstance(policy, ValuePolicy):
            policy.went_idle(key, tenant, 1, 40, now=clock.now - idle)
            policy.stored_form(key, False)
        manager.put(key, bytes(40))


@pytest.mark.parametrize("policy_kind, kept", [("lru", {"new-agent", "third"}), ("value", {"old-chat", "third"})])
def test_the_conversation_least_likely_to_return_moves_out_not_the_least_recent(policy_kind, kept):
    clock = Clock()
    policy = trained_policy(clock) if policy_kind == "value" else LruPolicy()
    manager = TierManager([DramTier(100)], policy=policy)
    fill(manager, policy, clock)
    assert manager.keys() == kept


@pytest.mark.parametrize("policy_kind, kept", [("lru", {"old-chat", "third"}), ("value", {"old-chat", "third"})])
def test_a_shutdown_saves_into_full_tiers_what_the_policy_would_keep(policy_kind, kept, tmp_path):
    """At shutdown DRAM's blobs move to a durable tier with room for two of the three, most worth keeping first,
    and none is moved out for one worth less: the value policy keeps the chat users who come back, LRU (with
    the agent's conversation pinned) the pinned one and the most recent."""
    clock = Clock()
    policy = trained_policy(clock, ("dram", "lmdb"))
    if policy_kind == "lru":
        policy = LruPlacement(CostProfile.tokens_only(bytes_per_token=1), ["dram", "lmdb"], clock=clock)
    manager = TierManager([DramTier(120), LmdbTier(tmp_path / "kv.lmdb", 80)], policy=policy)
    for key, tenant, idle in (("old-chat", "chat", 1_200.0), ("new-agent", "agent", 600.0), ("third", "chat", 0.0)):
        policy.went_idle(key, tenant, 1, 40, now=clock.now - idle, pinned=policy_kind == "lru" and key == "old-chat")
        policy.stored_form(key, False)
        manager.put(key, bytes(40))
    assert manager.save_volatile(clock.now + 60) == 3
    assert manager.keys() == kept and {manager.locate(key) for key in kept} == {"lmdb"}


def test_a_put_while_a_deleted_conversations_blob_is_still_placed_makes_room_without_error():
    """The service tells the policy of a delete before the delete reaches the tiers: a put meanwhile that needs
    room found the deleted key among its candidates without its books (KeyError): the new blob was written
    and never booked, over the tier's budget."""
    clock = Clock()
    policy = trained_policy(clock)
    manager = TierManager([DramTier(100)], policy=policy)
    fill(manager, policy, clock)
    policy.forget("old-chat")  # deleted; its blob goes next
    manager.put("fourth", bytes(40))
    assert manager.stats()[0]["errors"] == 0 and manager.tiers[0].usage() <= 100
    assert "fourth" in manager.keys()


def test_a_pinned_conversation_stays_while_anything_else_can_go():
    clock = Clock()
    policy = trained_policy(clock)
    manager = TierManager([DramTier(100)], policy=policy)
    policy.went_idle("new-agent", "agent", 1, 40, now=clock.now - 600.0, pinned=True)
    for key, tenant, idle in (("old-chat", "chat", 1_200.0), ("third", "chat", 0.0)):
        policy.went_idle(key, tenant, 1, 40, now=clock.now - idle)
    for key in ("old-chat", "new-agent", "third"):
        manager.put(key, bytes(40))
    assert manager.keys() == {"new-agent", "third"}


def test_the_compactor_is_told_what_is_worth_its_cpu():
    clock = Clock()
    policy = trained_policy(clock)
    policy.went_idle("chat-idle", "chat", 1, 1_000, now=clock.now)
    policy.went_idle("agent-gone", "agent", 1, 1_000, now=clock.now - 2 * HOUR)
    policy.went_idle("agent-typing", "agent", 1, 1_000, now=clock.now - 5.0)
    chat = policy.compress_decision("chat-idle")
    assert chat.priority is not None and chat.priority > 0
    gone = policy.compress_decision("agent-gone")  # its users come back within a minute or never
    assert gone.priority is None and gone.retry_at is None
    typing = policy.compress_decision("agent-typing")  # back any second: stays exact for now
    assert typing.priority is None and typing.retry_at == clock.now + SOON_S
    pressed = policy.compress_decision("agent-typing", pressed=True)  # the fast tier is full: compressed now
    assert pressed.priority is not None and pressed.priority > 0
    policy.stored_form("chat-idle", True)
    assert policy.compress_decision("chat-idle").priority is None  # already compressed


def test_predicted_and_actual_returns_are_counted():  # the dashboard's calibration
    clock = Clock()
    policy = trained_policy(clock)
    report = policy.report()
    assert report["returns_within_hour"] == 900  # all but the 100 agent conversations that never came back
    assert 0 < report["predicted_returns_within_hour"] <= 1_000


def test_a_blob_being_compressed_does_not_hide_the_exact_ones_behind_it():
    """tokens_only, 8x compression, a 100-byte tier: a (40 tokens, exact, being compressed: worth its coming
    5 bytes), b (40 tokens, exact) and c (80 tokens compressed to 10 bytes), away for 3, 2 and 1 minutes. A
    20-byte blob needs room: b is worth the least per byte, though a is the oldest exact blob."""
    clock = Clock()
    clock.now = 1_000.0
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=clock)
    manager = TierManager([DramTier(100)], policy=policy)
    for key, tokens, idle, compressed in (("a", 40, 180.0, False), ("b", 40, 120.0, False), ("c", 80, 60.0, True)):
        policy.went_idle(key, "t", 1, tokens, now=clock.now - idle)
        policy.stored_form(key, compressed)
        manager.put(key, bytes(tokens // 8 if compressed else tokens))
    policy.compressing("a")
    policy.went_idle("d", "t", 1, 20, now=clock.now)
    manager.put("d", bytes(20))
    assert manager.keys() == {"a", "c", "d"}


def test_conversations_stored_nowhere_and_long_gone_are_forgotten():
    """The books stay bounded: a week and a day after going idle, a conversation whose blob is stored nowhere
    leaves them (its idle time counted as a gap with no return); a stored one and a pinned one stay."""
    clock = Clock()
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=clock)
    manager = TierManager([DramTier(1_000)], policy=policy)
    for key in ("gone", "stored", "pinned"):
        policy.went_idle(key, "t", 1, 10, now=0.0, pinned=key == "pinned")
    manager.put("stored", bytes(10))
    clock.now = 8 * 86_400.0
    policy.expired()
    report = policy.report()
    assert report["held"] == 2 and report["forgotten"] == 1
    policy.turn_started("gone")  # a return it no longer waits for counts nothing
    assert policy.report()["returns_within_hour"] == 0


def test_a_return_counts_once_even_when_its_turn_fails_and_the_user_tries_again():
    """TurnRunner tells the policy a turn started before it knows whether it will commit: a refused or failed
    turn leaves no went_idle, and the retry must not count the same idle period's return twice."""
    clock = Clock()
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=clock)
    policy.went_idle("a", "t", 1, 10, now=0.0)
    policy.turn_started("a", now=20.0)
    policy.turn_started("a", now=40.0)  # the first try failed
    report = policy.report()
    assert report["returns_within_hour"] == 1 and sum(gap["returns"] for gap in report["return_gaps"]) == 1


def test_an_exact_copy_is_valued_by_its_conversation_and_never_above_its_blob():
    """An exact copy (sessions/exact_copy.py) helps only when its conversation comes back, and no more than
    its compressed blob does: a copy of a conversation unlikely to return leaves before that conversation's
    blob, where a copy valued on its own (a fresh, unknown conversation) outlived the blob it belongs to."""
    from statekeeper.sessions.exact_copy import copy_key

    clock = Clock()
    policy = trained_policy(clock)
    manager = TierManager([DramTier(100)], policy=policy)
    policy.went_idle("gone-agent", "agent", 1, 10, now=clock.now - 600.0)
    policy.stored_form("gone-agent", True)
    manager.put("gone-agent", bytes(10))  # compressed
    manager.put(copy_key("gone-agent"), bytes(60))  # its exact copy, one tier down in a real service
    policy.went_idle("live-chat", "chat", 1, 40, now=clock.now - 1_200.0)
    policy.stored_form("live-chat", False)
    manager.put("live-chat", bytes(40))  # needs 10 bytes: the copy or the blob goes
    assert manager.keys() == {"gone-agent", "live-chat"}


def test_an_exact_copy_leaves_the_books_without_counting_as_a_conversation_that_never_came_back():
    """A copy's books are its conversation's: forgetting them records no gap of their own (the return-gap
    model hears of each conversation once), and deleting the conversation drops its copy's books too."""
    from statekeeper.sessions.exact_copy import copy_key

    clock = Clock()
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=clock)
    manager = TierManager([DramTier(1_000)], policy=policy)
    for key in ("gone", "deleted"):
        policy.went_idle(key, "t", 1, 10, now=0.0)
        manager.put(copy_key(key), bytes(80))
        manager.delete(copy_key(key))
    policy.forget("deleted", now=1.0)
    assert policy.report()["held"] == 1  # "gone"; "deleted" and its copy are out of the books
    clock.now = 8 * 86_400.0
    policy.expired()
    report = policy.report()
    assert report["held"] == 0 and report["forgotten"] == 1


@pytest.mark.parametrize("story", ["adopted at start-up, then its user came back", "a failed turn, then deleted",
                                   "a failed turn, then forgotten after a week"])
def test_the_return_model_hears_of_each_idle_period_closed_once_and_only_if_it_was_opened(story):
    """A blob adopted at start-up (no idle period opened: the policy never heard it go idle) whose user came
    back closed a period that was never opened; a turn that failed after counting its return left the period
    to be closed again by a delete or by the week's pruning (a return after a minute counted as a week without
    one too). The model then held negative open periods, its chance of a return went out of [0, 1] (every
    eviction and compression decision after it nonsense), or was biased. It must know what a policy told only
    of the periods opened and closed (once) knows."""
    clock, reference_clock = Clock(), Clock()
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=clock)
    reference = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram"], clock=reference_clock)
    manager = TierManager([DramTier(10**6)], policy=policy)
    for number in range(3):
        key = f"c{number}"
        if story.startswith("adopted"):
            manager.put(key, bytes(100))  # the policy hears of it only from the tier manager
            clock.now += 60.0
            policy.turn_started(key)
        else:
            for told in (policy, reference):
                told.went_idle(key, "", 1, 100, now=clock.now)
                told.turn_started(key, now=clock.now + 60.0)  # for `policy`, a turn that then failed
            clock.now += 60.0
            if story.endswith("deleted"):
                policy.forget(key)
    clock.now += 8 * 86_400.0
    policy.expired()  # prunes what has been away a week
    for _ in range(2):  # an open period's exposure grows with time: so did a negative one's
        reference_clock.now = clock.now
        for idle in (0.0, 600.0, 86_400.0, 10 * 86_400.0):
            chance = policy.model.return_probability("", 1, idle, 3_600.0, clock.now)
            assert 0.0 <= chance <= 1.0
            assert chance == pytest.approx(reference.model.return_probability("", 1, idle, 3_600.0, clock.now))
        clock.now += 30 * 86_400.0


def test_the_eviction_books_stay_bounded_by_the_blobs_placed():
    """Every placement files an entry for eviction, and a blob placed again (each offload of each turn) left its
    old entry behind until it reached the top of a heap, which a tier that never fills never looks at: the books
    grew with every offload since start. They stay within a small multiple of the blobs placed."""
    clock = Clock()
    policy = ValuePolicy(CostProfile.tokens_only(bytes_per_token=1), ["dram", "ssd"], clock=clock)
    manager = TierManager([DramTier(10**9), DramTier(10**9)], policy=policy)
    for turn in range(200):
        for key in (f"c{number}" for number in range(50)):
            clock.now += 1.0
            policy.went_idle(key, "t", turn + 1, 10, now=clock.now)
            manager.put(key, bytes(10))
    assert len(manager.keys()) == 50
    assert policy.report()["book_entries"] <= 2 * 50 + 64


def test_the_expiry_queue_stays_bounded_by_the_conversations_with_a_ttl():
    """Each turn queued its conversation's new expiry and the one it replaced stayed until its time came: with a
    day's TTL a day of turns was queued, deleted conversations' too."""
    clock = Clock()
    policy = trained_policy(clock)
    for turn in range(20):
        for number in range(1_000):
            policy.went_idle(f"chat-{number}", "chat", turn + 1, 40, now=clock.now + turn, ttl_s=86_400.0)
    assert policy.report()["expiry_entries"] <= 2 * 1_000 + 64
    for number in range(1_000):
        policy.forget(f"chat-{number}")
    for number in range(200):  # new conversations' turns: the queue is rebuilt from the books
        policy.went_idle(f"new-{number}", "chat", 1, 40, now=clock.now, ttl_s=86_400.0)
    assert policy.report()["expiry_entries"] <= 2 * 200 + 64
    clock.now += 86_400.0 + 60
    assert sorted(policy.expired()) == sorted(f"new-{number}" for number in range(200))
