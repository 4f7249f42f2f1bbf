"""Exact copies (issue 33, EXACT_COPY_TIER): when a conversation's stored state is compressed, its exact state
stays in a colder tier under its own key, and a restore of the compressed blob takes it instead: whole (the
replies of a state never compressed), or the working set the blob names (COMPRESSION_LIVE_KEEP: the turn's
prompt attends every row, its reply those entries, exact; held-out recall in BENCHMARKS.md; after that reply
every row is attended again, as the state it stores is). The copy is a cache
of a cache: missing, stale (another number of tokens) or corrupt, the compressed blob restores as it does
without one, and a bad copy is deleted."""

from __future__ import annotations

from dataclasses import dataclass

from statekeeper.placement.policy import COPY_SUFFIX

SUFFIX = COPY_SUFFIX  # conversation ids are [A-Za-z0-9_-]: none ends so (the placement policy values copies by it)


def copy_key(session_id: str) -> str:
    return session_id + SUFFIX


def delete_stored(tiers, session_id: str) -> None:
    """The conversation's stored blob and its exact copy, from every tier (TierManager)."""
    tiers.delete(session_id)
    tiers.delete(copy_key(session_id))


def session_of(key: str) -> str | None:
    """The conversation an exact copy's key belongs to; None for any other key."""
    return key[: -len(SUFFIX)] if key.endswith(SUFFIX) else None


@dataclass(slots=True)
class CopyCounters:
    kept: int = 0  # copies stored when a blob was compressed
    not_kept: int = 0  # ... that no tier could take
    restores: int = 0  # compressed restores that took the copy
    missing: int = 0  # compressed restores that found no copy (evicted, or never kept)
    rejected: int = 0  # copies that failed their checks or were stale: deleted
