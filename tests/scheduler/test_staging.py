import pytest

from scheduler.staging import ALIGNMENT, host_waits, layer_groups, plan_staging, ring_shape, schedule_layers


def _overlap(a, b) -> bool:
    return a.slot == b.slot and a.offset < b.offset + b.nbytes and b.offset < a.offset + a.nbytes


def test_copies_are_packed_in_order_and_aligned():
    placed = plan_staging([1000, 1000, 3000, 10], slot_bytes=4096, num_slots=2)
    assert [(c.slot, c.offset) for c in placed] == [(0, 0), (0, 1024), (1, 0), (1, 3072)]
    assert all(c.offset % ALIGNMENT == 0 and c.offset + c.nbytes <= 4096 for c in placed)
    assert host_waits(placed) == 0


def test_a_slot_is_reused_only_after_its_last_copy_of_the_previous_round():
    sizes = [3000] * 7  # one copy per slot, three slots: copies 3..6 go round again
    placed = plan_staging(sizes, slot_bytes=4096, num_slots=3)
    assert [c.slot for c in placed] == [0, 1, 2, 0, 1, 2, 0]
    assert [c.after for c in placed] == [None, None, None, 0, 1, 2, 3]
    # no two copies share bytes unless the later one waits for the earlier one (or one after it in the slot)
    for later in placed:
        for earlier in placed[: later.index]:
            if _overlap(earlier, later):
                assert later.after is not None and later.after >= earlier.index


def test_several_copies_in_a_slot_wait_once_for_the_last_of_the_previous_round():
    placed = plan_staging([1000] * 8, slot_bytes=2048, num_slots=2)  # two per slot
    assert [c.slot for c in placed] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c.after for c in placed] == [None, None, None, None, 1, None, 3, None]


def test_a_copy_larger_than_a_slot_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        plan_staging([5000], slot_bytes=4096, num_slots=4)


@pytest.mark.parametrize("sizes", [[7_000] * 60, [3 * 1536 * 64 * 2] * 60, [100, 70_000, 5, 33_333] * 9])
@pytest.mark.parametrize("slots", [2, 4, 5])
def test_a_ring_shaped_for_a_restore_stages_it_without_a_host_wait(sizes, slots):
    slot_bytes, num_slots = ring_shape(sizes, slots)
    placed = plan_staging(sizes, slot_bytes, num_slots)
    assert host_waits(placed) == 0 and num_slots == slots
    assert slot_bytes % ALIGNMENT == 0


def test_each_layer_of_the_message_waits_for_its_own_copy_and_the_prefix_for_none():
    schedule = schedule_layers(num_layers=30, num_tokens=4096, recompute_tokens=512)
    assert [s.message_waits_for for s in schedule] == [s.event for s in schedule] == list(range(30))
    assert all(s.prefix_waits_for is None and s.copy_rows == (512, 4096) for s in schedule)
    with pytest.raises(ValueError):
        schedule_layers(4, 100, 101)


def test_a_grouped_restore_waits_for_its_groups_event():
    groups = layer_groups(30, 4)
    assert [len(group) for group in groups] == [8, 8, 7, 7]
    schedule = schedule_layers(30, 4096, 0, groups)
    assert [s.message_waits_for for s in schedule] == [0] * 8 + [1] * 8 + [2] * 7 + [3] * 7
    assert layer_groups(3, 8) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="cover"):
        schedule_layers(4, 10, 0, [range(0, 2), range(3, 4)])
