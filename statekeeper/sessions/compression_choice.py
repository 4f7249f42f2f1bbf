"""Which compression a conversation's stored KV gets: the service's, with the conversation's own overrides
(validated when it is created), and the calibrated per-head budgets for this model where they exist."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from statekeeper.compression.head_profile import HeadProfile, load_profile
from statekeeper.config import CompressionConfig
from statekeeper.sessions.errors import InvalidRequest


class CompressionChoice:
    def __init__(self, default: CompressionConfig, profile_dir: Path | None, fingerprint: str,
                 heads: tuple[int, int]):
        """`heads`: the model's layers and KV heads, the shape a profile's tables must have."""
        self.default = default
        self.profile_dir = profile_dir
        self.fingerprint = fingerprint
        self.heads = heads
        self._profiles: dict[str, HeadProfile | None] = {}

    def of(self, overrides: dict | None) -> CompressionConfig:
        """The compression for a conversation with these overrides; invalid ones are a 400."""
        try:
            return CompressionConfig(**(dataclasses.asdict(self.default) | (overrides or {})))
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"invalid compression options: {exc}") from None

    def head_profile(self, scorer: str) -> HeadProfile | None:
        """The calibrated per-head budgets for this model and scorer, loaded once found; until then looked
        for again each time, so a profile that `statekeeper calibrate` writes beside a running service is
        used from then on."""
        if self._profiles.get(scorer) is None and self.profile_dir is not None:
            self._profiles[scorer] = load_profile(self.profile_dir, self.fingerprint, scorer, self.heads)
        return self._profiles.get(scorer)

    def notes(self) -> list[str]:
        """What /healthz says is missing: the calibration the default compression asks for."""
        config = self.default
        if config.policy == "heads" and config.budgets == "calibrated" and self.head_profile(config.scorer) is None:
            return [f"no calibrated per-head profile for {config.scorer} on this model: uniform budgets "
                    "(run `statekeeper calibrate`)"]
        return []
