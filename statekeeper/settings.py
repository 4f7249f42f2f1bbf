"""Service settings: STATEKEEPER_* environment variables and an optional env file, validated here and
turned into the plain dataclasses of config.py for everything inside."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from statekeeper.config import MiB, ServiceConfig, SessionConfig, TierConfig, WorkerConfig


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "statekeeper"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STATEKEEPER_", env_file=None, extra="ignore")

    environment: Literal["development", "production"] = "development"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    data_dir: Path = Field(default_factory=default_data_dir)

    model: str = "smollm2"
    model_cache_dir: Path | None = None  # defaults to <data_dir>/models
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # One thread measured faster than two for single-session turns on the 2-core machine (BENCHMARKS.md).
    torch_threads: int = Field(1, ge=1)
    prefill_chunk_tokens: int = Field(512, ge=16)

    idle_offload_seconds: float = Field(300.0, ge=0)
    active_kv_budget_mb: int = Field(2048, ge=1)
    max_content_chars: int = Field(32_000, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)

    dram_enabled: bool = True
    dram_budget_mb: int = Field(1024, ge=1)
    lmdb_enabled: bool = True
    lmdb_budget_mb: int = Field(16_384, ge=1)
    lmdb_path: Path | None = None  # defaults to <data_dir>/kv.lmdb

    def to_config(self) -> ServiceConfig:
        data_dir = self.data_dir.expanduser()
        tiers = []
        if self.dram_enabled:
            tiers.append(TierConfig("dram", self.dram_budget_mb * MiB))
        if self.lmdb_enabled:
            tiers.append(TierConfig("lmdb", self.lmdb_budget_mb * MiB, self.lmdb_path or data_dir / "kv.lmdb"))
        return ServiceConfig(
            data_dir=data_dir,
            worker=WorkerConfig(
                model=self.model,
                model_cache_dir=(self.model_cache_dir or data_dir / "models").expanduser(),
                device=self.device,
                dtype=self.dtype,
                num_threads=self.torch_threads,
                prefill_chunk_tokens=self.prefill_chunk_tokens,
            ),
            sessions=SessionConfig(
                idle_offload_seconds=self.idle_offload_seconds,
                active_kv_budget_bytes=self.active_kv_budget_mb * MiB,
                max_content_chars=self.max_content_chars,
                max_tokens_limit=self.max_tokens_limit,
            ),
            tiers=tiers,
        )


def load_settings(env_file: str | Path | None = None, **overrides) -> Settings:
    """Environment variables win over the env file; explicit overrides (CLI flags) win over both."""
    env_file = env_file or os.environ.get("STATEKEEPER_ENV_FILE")
    return Settings(_env_file=env_file, **{k: v for k, v in overrides.items() if v is not None})
