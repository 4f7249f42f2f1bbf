"""The bookkeeping of a GPU restore, in plain Python (no torch), so it is unit-tested without a GPU:
where each host-to-device copy is staged in a ring of pinned host buffers, and which CUDA event each
layer's forward waits for (statekeeper/device_restore.py carries the plan out).

Staging: a tier read that is not already in pinned memory (an LMDB or SSD memory map, a Redis reply) is
copied once into a slot of the ring, and the copy engine reads it from there. Copies are packed into the
current slot in order; a copy that does not fit starts the next slot, and going round to a slot again means
waiting until the last copy staged in it has left (its event): the only host wait of a restore, and none
while the ring holds the whole restore. Slots are allocated once, sized from the profile (`ring_shape`).

Events: the copy stream records one event per layer after that layer's last copy; the compute stream
recomputes the planned prefix without waiting (its rows are its own), then runs the new message's forward,
whose layer l waits for event l only: layer l computes while layers after it are still copying (Krul §6)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SLOTS = 4
ALIGNMENT = 512  # bytes: each staged copy starts on the copy engine's preferred boundary


@dataclass(frozen=True, slots=True)
class StagedCopy:
    index: int  # the copy's place in the restore's order
    slot: int
    offset: int  # bytes into the slot
    nbytes: int
    # The copy that must have left the slot before this one is written there (its event is waited for on
    # the host), or None: the slot's part is free without waiting.
    after: int | None


def plan_staging(sizes: list[int], slot_bytes: int, num_slots: int) -> list[StagedCopy]:
    """Places copies of `sizes` bytes, in order, into a ring of `num_slots` slots of `slot_bytes` each (each
    offset ALIGNMENT-aligned). ValueError for a copy larger than a
    slot: the ring is sized to hold the largest one (`ring_shape`)."""
    if slot_bytes <= 0 or num_slots <= 0:
        raise ValueError("a staging ring needs slots of some bytes")
    placed: list[StagedCopy] = []
    last_in_slot: list[int | None] = [None] * num_slots  # the last copy staged in each slot, before this round
    slot, offset, filling = 0, 0, []
    for index, size in enumerate(sizes):
        if size > slot_bytes:
            raise ValueError(f"a copy of {size} bytes does not fit a staging slot of {slot_bytes}")
        if offset + size > slot_bytes:  # the next slot; its previous round's copies must have left
            last_in_slot[slot] = filling[-1] if filling else last_in_slot[slot]
            slot, offset, filling = (slot + 1) % num_slots, 0, []
        after = last_in_slot[slot] if not filling else None
        placed.append(StagedCopy(index, slot, offset, size, after))
        filling.append(index)
        offset += _aligned(size)
    return placed


def host_waits(placed: list[StagedCopy]) -> int:
    """How many copies make the host wait for an earlier one (0 while the ring holds the whole restore)."""
    return sum(copy.after is not None for copy in placed)


def _aligned(size: int) -> int:
    return -(-size // ALIGNMENT) * ALIGNMENT


def ring_shape(copy_sizes: list[int], num_slots: int = DEFAULT_SLOTS) -> tuple[int, int]:
    """(slot bytes, slots) of a ring that stages the copies of the largest restore the profile plans for
    (every layer's K and V at its longest conversation) without a host wait: the restore spread over the
    slots plus one largest copy of slack per slot (packing in order leaves less than that unused at a
    slot's end)."""
    aligned = [_aligned(size) for size in copy_sizes] or [ALIGNMENT]
    spread = max(max(aligned), _aligned(-(-sum(aligned) // num_slots)))
    return spread + max(aligned), num_slots


@dataclass(frozen=True, slots=True)
class LayerSchedule:
    """One layer of a GPU restore: the rows copied (token range) before its event, and what its forwards
    wait for: the prefix recompute waits for nothing, the new message's forward for this layer's event."""

    layer: int
    copy_rows: tuple[int, int]
    event: int  # index of the event recorded after the layer's copies (its group's, in a grouped restore)
    prefix_waits_for: int | None = None
    message_waits_for: int | None = None


def layer_groups(num_layers: int, num_groups: int) -> list[range]:
    """Consecutive layers in `num_groups` groups (the first ones one larger where they do not divide)."""
    size, extra = divmod(num_layers, max(1, min(num_groups, num_layers)))
    groups, start = [], 0
    while start < num_layers:
        end = start + size + (1 if len(groups) < extra else 0)
        groups.append(range(start, end))
        start = end
    return groups


def schedule_layers(num_layers: int, num_tokens: int, recompute_tokens: int,
                    groups: list[range] | None = None) -> list[LayerSchedule]:
    """The event schedule of a restore that recomputes tokens [0, r) and copies [r, N) of every layer;
    `groups`: consecutive layers copied (and decoded) together behind one event (a compressed restore),
    by default one layer each."""
    if not 0 <= recompute_tokens <= num_tokens:
        raise ValueError("the recomputed prefix must lie within the history")
    groups = groups if groups is not None else [range(layer, layer + 1) for layer in range(num_layers)]
    if [layer for group in groups for layer in group] != list(range(num_layers)):
        raise ValueError("the groups must cover the layers in order, each once")
    return [LayerSchedule(layer, (recompute_tokens, num_tokens), number, None, number)
            for number, group in enumerate(groups) for layer in group]
