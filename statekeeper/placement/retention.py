"""Retention controls (issue 32): what an operator or a client says about keeping a conversation's stored KV,
per conversation and as a tenant's default. The history stays in every case: these govern the KV, a cache.

    pinned       its stored KV leaves a tier only when nothing unpinned is left to move, and its KV in memory
                 is offloaded for the active budget after every unpinned one
    priority     low | normal | high: weighs its value to the placement policy (PRIORITY_WEIGHTS) and orders
                 the active budget's offloads after recency
    ttl_seconds  its stored KV is dropped this long after its last turn (its next turn recomputes)

A conversation's own settings override its tenant's, field by field."""

from __future__ import annotations

from dataclasses import dataclass

PRIORITY_WEIGHTS = {"low": 0.25, "normal": 1.0, "high": 4.0}
PRIORITIES = tuple(PRIORITY_WEIGHTS)
FIELDS = ("pinned", "priority", "ttl_seconds")
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 60, 365 * 86_400
# OpenAI's `prompt_cache_retention`: "24h" keeps the cached prefix up to a day; "in_memory" is the default.
OPENAI_RETENTION = {"in_memory": {}, "24h": {"priority": "high", "ttl_seconds": 86_400}}


@dataclass(frozen=True, slots=True)
class Retention:
    pinned: bool = False
    priority: str = "normal"
    ttl_seconds: int | None = None

    def __post_init__(self):
        if not isinstance(self.pinned, bool):
            raise ValueError("pinned must be true or false")
        if self.ttl_seconds is not None and (isinstance(self.ttl_seconds, bool) or not isinstance(self.ttl_seconds, int)):
            raise ValueError("ttl_seconds must be a whole number of seconds")
        if not isinstance(self.priority, str) or self.priority not in PRIORITY_WEIGHTS:
            raise ValueError(f"priority must be one of {', '.join(PRIORITY_WEIGHTS)}")
        if self.ttl_seconds is not None and not MIN_TTL_SECONDS <= self.ttl_seconds <= MAX_TTL_SECONDS:
            raise ValueError(f"ttl_seconds must be between {MIN_TTL_SECONDS} and {MAX_TTL_SECONDS}")

    @property
    def weight(self) -> float:
        return PRIORITY_WEIGHTS[self.priority]

    @classmethod
    def of(cls, *layers: dict | None) -> "Retention":
        """The settings of `layers` (each a dict of some FIELDS, e.g. a tenant's then a conversation's), later
        ones overriding earlier ones field by field. Raises ValueError for an unknown field or value."""
        merged: dict = {}
        for layer in layers:
            unknown = set(layer or ()) - set(FIELDS)
            if unknown:
                raise ValueError(f"unknown retention fields: {', '.join(sorted(unknown))}")
            merged |= {name: value for name, value in (layer or {}).items() if value is not None}
        return cls(**merged)


def checked(settings: dict | None) -> dict | None:
    """`settings` (some FIELDS) as stored with a conversation, after checking them: None for none."""
    if not settings:
        return None
    Retention.of(settings)
    return dict(settings)
