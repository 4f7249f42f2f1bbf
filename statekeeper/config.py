"""Plain dataclass configuration used inside the service (settings.py builds these at the boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

MiB = 1024 * 1024


@dataclass(slots=True)
class WorkerConfig:
    model: str = "smollm2"  # "smollm2" (bundled GGUF) or a local Hugging Face model directory
    model_cache_dir: Path = Path("models")
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    num_threads: int = 1
    prefill_chunk_tokens: int = 512
    keep_freed_memory_warm: bool = True  # see statekeeper/memory.py

    def __post_init__(self):
        if self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.prefill_chunk_tokens < 16:
            raise ValueError("prefill_chunk_tokens must be >= 16")


@dataclass(slots=True)
class TierConfig:
    name: str  # dram | lmdb | ssd | redis
    budget_bytes: int
    path: Path | None = None  # lmdb, ssd
    url: str | None = None  # redis:// or rediss://
    password: str | None = None
    key_prefix: str = "statekeeper:"
    ttl_seconds: int | None = None
    chunk_bytes: int = 8 * MiB

    def __post_init__(self):
        if self.budget_bytes <= 0:
            raise ValueError(f"tier {self.name}: budget must be positive")


@dataclass(slots=True)
class SessionConfig:
    idle_offload_seconds: float = 300.0
    active_kv_budget_bytes: int = 2048 * MiB
    max_content_chars: int = 32_000
    max_tokens_limit: int = 4096
    sweep_interval_seconds: float = 1.0

    def __post_init__(self):
        if self.idle_offload_seconds < 0:
            raise ValueError("idle_offload_seconds must be >= 0")


@dataclass(slots=True)
class ServiceConfig:
    data_dir: Path
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    tiers: list[TierConfig] = field(default_factory=list)
    promote_on_read: bool = False
    admin_token: str | None = None

    @property
    def history_path(self) -> Path:
        return self.data_dir / "history.lmdb"

    @property
    def tier_index_path(self) -> Path:
        return self.data_dir / "kv-index.lmdb"
