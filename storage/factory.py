"""Builds the tier stack from configuration (the only place that knows every tier class)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from storage.tier import Tier
from storage.tier_config import TierConfig
from storage.dram import DramTier
from storage.index import LmdbTierIndex, MemoryTierIndex
from storage.lmdb_tier import LmdbTier
from storage.manager import TierManager
from storage.redis_tier import RedisTier
from storage.ssd import SsdTier


def build_tier(config: TierConfig, dram_buffer: Callable[[int], memoryview] | None = None) -> Tier:
    """`dram_buffer`: the memory the DRAM tier copies its blobs into (storage/dram.py), if not their own."""
    if config.name == "dram":
        return DramTier(config.budget_bytes, dram_buffer)
    if config.name in ("lmdb", "ssd"):
        if config.path is None:
            raise ValueError(f"the {config.name} tier needs a path")
        tier_class = LmdbTier if config.name == "lmdb" else SsdTier
        return tier_class(config.path, config.budget_bytes)
    if config.name == "redis":
        if not config.url or not config.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("the redis tier needs a redis:// or rediss:// URL")
        return RedisTier(config.url, config.budget_bytes, prefix=config.key_prefix, ttl_seconds=config.ttl_seconds,
                         chunk_bytes=config.chunk_bytes, password=config.password, secret=config.secret)
    raise ValueError(f"unknown tier {config.name!r}")


def build_tier_manager(configs: list[TierConfig], index_path: Path | None = None, promote_on_read: bool = False,
                       transcoder: Callable[[str], Callable] | None = None,
                       dram_buffer: Callable[[int], memoryview] | None = None) -> TierManager:
    """`transcoder(codec)`: the bytes-to-bytes function for a tier with a codec (the service passes
    statekeeper.compression.transcode.Transcoder; storage itself never decodes a blob); `dram_buffer`: see
    build_tier (a GPU worker's service passes page-locked memory)."""
    index = LmdbTierIndex(index_path) if index_path else MemoryTierIndex()
    transcoders = {c.name: transcoder(c.codec) for c in configs if c.codec != "none" and transcoder is not None}
    return TierManager([build_tier(config, dram_buffer) for config in configs], index, promote_on_read=promote_on_read,
                       transcoders=transcoders)
