"""Builds the tier stack from configuration (the only place that knows every tier class)."""

from __future__ import annotations

from statekeeper.config import TierConfig
from storage.base import Tier
from storage.dram import DramTier
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager


def build_tier(config: TierConfig) -> Tier:
    if config.name == "dram":
        return DramTier(config.budget_bytes)
    if config.name == "lmdb":
        if config.path is None:
            raise ValueError("the lmdb tier needs a path")
        return LmdbTier(config.path, config.budget_bytes)
    raise ValueError(f"unknown tier {config.name!r}")


def build_tier_manager(configs: list[TierConfig]) -> TierManager:
    return TierManager([build_tier(config) for config in configs])
