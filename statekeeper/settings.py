"""Service settings: STATEKEEPER_* environment variables and an optional env file, validated here and
turned into the plain dataclasses of config.py for everything inside."""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from statekeeper.config import (CODEC_PATTERN, KV_DTYPES, LANE_SETTINGS, TOOL_CALL_FORMATS, WEIGHT_PRECISION_PATTERN, CompressionConfig,
                                HistoryConfig, LeaseConfig, MiB, ServiceConfig, SessionConfig, TierConfig, WorkerConfig,
                                codec_options)
from statekeeper.placement.policy import PLACEMENT_POLICIES
from statekeeper.tenancy import TenantLimits


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "statekeeper"


class Settings(BaseSettings):
    # A refused setting is logged at start: its error must not echo what it refused (tokens, secrets).
    model_config = SettingsConfigDict(env_prefix="STATEKEEPER_", env_file=None, extra="ignore", hide_input_in_errors=True)

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
    keep_freed_memory_warm: bool = True
    # The linear layers' weights: auto | fp32 | int8 | dyn-int8 | int4-g<N> [-fphead | -int8head]
    # (config.WEIGHT_PRECISION; the choice and its measurements: README, BENCHMARKS.md issue 17).
    # Stored KV records it.
    weight_precision: str = Field("auto", pattern=WEIGHT_PRECISION_PATTERN)
    kv_dtype: Literal[KV_DTYPES] = "auto"  # the live KV cache's: WorkerConfig.kv_dtype, which checks the same list
    gemm_rows: int | None = Field(None, ge=1)  # WorkerConfig.gemm_rows; unset: measured at start
    chat_template: Path | None = None  # a Jinja file instead of the model's template (checked when the worker loads it)
    tool_call_format: Literal[TOOL_CALL_FORMATS] = "auto"  # WorkerConfig.tool_call_format, which checks the same list

    idle_offload_seconds: float = Field(300.0, ge=0)
    active_kv_budget_mb: int = Field(2048, ge=1)
    max_content_chars: int = Field(32_000, ge=1)
    max_tokens_limit: int = Field(4096, ge=1)
    compress_after_seconds: float = Field(600.0, ge=0)  # a stored blob idle this long is compressed (lru)
    # A tier below the fastest that keeps compressed conversations' exact states (SessionConfig.exact_copy_tier,
    # checked with the tiers by ServiceConfig); "" keeps none
    exact_copy_tier: Literal["", "lmdb", "ssd", "redis"] = ""
    placement_policy: Literal[PLACEMENT_POLICIES] = "value"  # SessionConfig.placement_policy, which checks the same list
    trace_file: Path | None = None  # opt-in: the service's own traffic as a simulator trace (no text)
    # JSON: {"tenant" or "*": {"pinned": bool, "priority": "low|normal|high", "ttl_seconds": n}}; SessionConfig checks it
    tenant_retention: dict[str, dict] = {}
    compress_quiet_seconds: float = Field(1.0, ge=0)
    compress_chunk_tokens: int = Field(64, ge=16)
    compress_process: bool = True  # compress in a child process with its own model copy (another core)
    max_concurrent_turns: int = Field(32, ge=1)  # one more gets 429 with Retry-After
    batch_max_sessions: int = Field(16, ge=1)  # conversations one forward advances; 1 runs each alone
    batch_prefill_tokens: int = Field(512, ge=16)  # prefill tokens a step carries beside the decoders
    long_prefill_lane: Literal[LANE_SETTINGS] = "auto"  # SessionConfig.long_prefill_lane, which checks the same list
    max_idle_sessions: int = Field(10_000, ge=0)  # idle conversations kept in memory (LRU beyond)
    max_idle_mb: int = Field(256, ge=0)  # ... and the bytes they may hold
    max_body_mb: int = Field(8, ge=1)  # a larger request body gets 413 before it is read
    give_back_memory_after_seconds: float = Field(10.0, ge=0)  # quiet this long: freed memory goes back to the OS
    shutdown_seconds: float = Field(8.0, ge=0)  # storing active states at shutdown stops after this long
    # Before that, requests under way get this long to finish, then are cancelled (a cancelled turn leaves its
    # history as it was): uvicorn alone waited for them without a bound, past a container's stop timeout.
    drain_seconds: float = Field(5.0, ge=0, le=600)
    # Each tenant's limits (0: none); one more gets 429 with Retry-After (statekeeper.tenancy.TenantLimits).
    tenant_max_sessions: int = Field(0, ge=0)
    tenant_max_stored_mb: int = Field(0, ge=0)
    tenant_requests_per_minute: int = Field(0, ge=0)
    tenant_max_concurrent_turns: int = Field(0, ge=0)

    dram_enabled: bool = True
    dram_budget_mb: int = Field(1024, ge=1)
    dram_codec: str = Field("none", pattern=CODEC_PATTERN)  # re-encode blobs landing here (int4 ...)
    lmdb_enabled: bool = True
    lmdb_budget_mb: int = Field(16_384, ge=1)
    lmdb_codec: str = Field("none", pattern=CODEC_PATTERN)  # re-encode blobs landing here (int4 ...)
    lmdb_path: Path | None = None  # defaults to <data_dir>/kv.lmdb
    ssd_enabled: bool = False
    ssd_budget_mb: int = Field(65_536, ge=1)
    ssd_codec: str = Field("none", pattern=CODEC_PATTERN)  # re-encode blobs landing here (int4 ...)
    ssd_path: Path | None = None  # defaults to <data_dir>/kv-files; point it at another disk
    redis_enabled: bool = False
    redis_url: str = Field("redis://127.0.0.1:6379/0", repr=False)  # may hold a password: never shown
    redis_password: SecretStr | None = None
    # The key for the MAC on KV blobs in Redis and for its key names; every replica sharing the Redis needs
    # the same. Without it (development only) the service keeps a random one in <data_dir>/blob-secret.
    blob_secret: SecretStr | None = None
    # The key of the index that finds a conversation by its messages (statekeeper/prefix_index.py); replicas
    # sharing one history need the same. Without it the service keeps a random one in <data_dir>/index-secret.
    index_secret: SecretStr | None = None
    redis_budget_mb: int = Field(65_536, ge=1)
    redis_codec: str = Field("none", pattern=CODEC_PATTERN)  # re-encode blobs landing here (int4 ...)
    redis_key_prefix: str = "statekeeper:"
    redis_ttl_seconds: int | None = Field(None, ge=1)
    redis_chunk_mb: int = Field(8, ge=1)
    promote_on_read: bool = False
    restore_planning: bool = True
    admin_token: SecretStr | None = None
    # Where the conversation history lives: LMDB in the data directory (one process, the default), or
    # PostgreSQL at POSTGRES_DSN, shared by replicas that each serve any conversation.
    history_backend: Literal["lmdb", "postgres"] = "lmdb"
    postgres_dsn: SecretStr | None = None  # postgresql://user:password@host:5432/db (or key=value pairs)
    postgres_pool_size: int = Field(8, ge=1, le=256)
    postgres_connect_timeout_seconds: float = Field(5.0, gt=0)
    # Replicas sharing the PostgreSQL history coordinate through a per-conversation lease in this Redis
    # (usually the Redis of the shared tier, REDIS_URL; set on its own, since the tier may be off). It
    # uses REDIS_PASSWORD and REDIS_KEY_PREFIX as the tier does. Unset: no coordination (one replica).
    lease_redis_url: str | None = Field(None, repr=False)
    lease_ttl_ms: int = Field(10_000, ge=100)
    lease_wait_seconds: float = Field(2.0, ge=0)
    # API keys on every /v1 route but /v1/admin: by default whenever the service is reachable from another
    # machine (a host other than loopback) or runs in production; a loopback development service is open.
    auth: Literal["none", "api_key"] | None = None
    # Without API keys, the Host names the service answers to besides its listen address and the loopback
    # names (api/browser_guard.py: a web page rebound to 127.0.0.1 sends its own name). Comma-separated.
    allowed_hosts: str = ""
    # GET /metrics without the admin token, for a Prometheus that cannot send one; it names no conversation
    # but tells anyone who reaches the port how busy the service is.
    metrics_public: bool = False
    # A token for GET /metrics only (a Prometheus' bearer token): unlike the admin token it mints no keys.
    metrics_token: SecretStr | None = None
    # What one client's connections may hold (api/server.py, api/streaming.py): a request's headers must
    # arrive within HEADER_TIMEOUT_SECONDS; a streamed turn whose client reads nothing for
    # SEND_TIMEOUT_SECONDS ends as if the client had left; at most MAX_CONNECTIONS (503 above).
    header_timeout_seconds: float = Field(10.0, gt=0, le=600)
    send_timeout_seconds: float = Field(30.0, gt=0, le=3600)
    max_connections: int = Field(1000, ge=1)
    send_buffer_kb: int = Field(16, ge=4, le=4096)  # each connection's kernel send buffer (api/server.py)

    compression_policy: Literal["none", "krul", "krul_fixed", "minicache", "heads"] = "heads"
    compression_ratio: float = Field(0.2, ge=0, le=1)
    compression_gamma: float = Field(0.6, ge=0, le=1)
    compression_t: float = Field(0.5, ge=0, le=1)
    compression_retain_angle: float = Field(0.5, ge=0, le=1)
    compression_share_keys: bool = False
    compression_share_values: bool = True
    compression_codec: str = Field("int4-v3-rot-sym-pk8-s1", pattern=CODEC_PATTERN)
    compression_group_size: int = Field(64, ge=1, le=4096)
    compression_keep: float = Field(0.5, gt=0, le=1)
    compression_scorer: Literal["expected", "snapkv", "kvzip"] = "kvzip"
    compression_budgets: Literal["adaptive", "uniform", "calibrated", "global"] = "global"
    compression_merge: bool = False
    # With EXACT_COPY_TIER: the share a reply attends after a restore from the copy (CompressionConfig.live_keep)
    compression_live_keep: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _refuse_tier_codecs_the_codec_cannot_take(self) -> "Settings":
        """The pattern admits group sizes that are not powers of two: checked by the codec's own parser, for a
        tier that is off too (the service config checks the tiers it builds)."""
        for codec in (self.dram_codec, self.lmdb_codec, self.ssd_codec, self.redis_codec):
            codec_options(codec)
        return self

    @model_validator(mode="after")
    def _refuse_a_weak_blob_secret(self) -> "Settings":
        # Both key BLAKE2b (Redis key names and MACs, the conversation index), which takes at most 64 bytes
        longest = hashlib.blake2b.MAX_KEY_SIZE
        for name, secret in (("BLOB_SECRET", self.blob_secret), ("INDEX_SECRET", self.index_secret)):
            if secret is not None and not 32 <= len(secret.get_secret_value().encode()) <= longest:
                raise ValueError(f"STATEKEEPER_{name} needs 32 to {longest} bytes")
        if self.environment == "production" and self.redis_enabled and self.blob_secret is None:
            raise ValueError("production with Redis needs STATEKEEPER_BLOB_SECRET (at least 32 bytes, the same "
                             "on every replica)")
        # Replicas over one history find a conversation by its messages only under one key: each replica's own
        # re-keys the conversations it commits, and clients resending their messages lose them
        if self.environment == "production" and self.history_backend == "postgres" and self.index_secret is None:
            raise ValueError("production with a PostgreSQL history needs STATEKEEPER_INDEX_SECRET (at least 32 "
                             "bytes, the same on every replica)")
        return self

    @model_validator(mode="after")
    def _refuse_a_postgres_history_without_a_dsn(self) -> "Settings":
        if self.history_backend != "postgres":
            return self
        if self.postgres_dsn is None:
            raise ValueError("STATEKEEPER_HISTORY_BACKEND=postgres needs STATEKEEPER_POSTGRES_DSN")
        from psycopg.conninfo import conninfo_to_dict

        try:
            conninfo_to_dict(self.postgres_dsn.get_secret_value())
        except Exception:  # noqa: BLE001 - its message may quote the DSN, password included
            raise ValueError("STATEKEEPER_POSTGRES_DSN is not a PostgreSQL connection string") from None
        return self

    @model_validator(mode="after")
    def _refuse_unsafe_production_defaults(self) -> "Settings":
        admin_token = _revealed(self.admin_token) or None  # empty (ADMIN_TOKEN=): the admin API is off
        if self.environment == "production" and admin_token is None:
            raise ValueError("production needs STATEKEEPER_ADMIN_TOKEN of at least 16 characters")
        # In any environment: it mints keys for every tenant and has no rate limit; blank characters are trimmed
        # from a header's value, so a token of them could never be sent.
        if admin_token is not None and len(admin_token.strip()) < 16:
            raise ValueError("STATEKEEPER_ADMIN_TOKEN needs at least 16 characters, not blank")
        if admin_token is not None and admin_token != admin_token.strip():
            raise ValueError("STATEKEEPER_ADMIN_TOKEN must not begin or end with blanks: no request carries them")
        if self.metrics_token is not None and len(self.metrics_token.get_secret_value()) < 16:
            raise ValueError("STATEKEEPER_METRICS_TOKEN needs at least 16 characters")
        if self.metrics_token is not None and self.metrics_token == self.admin_token:
            raise ValueError("STATEKEEPER_METRICS_TOKEN must not be the admin token: it is the one a scraper holds")
        return self

    @model_validator(mode="after")
    def _refuse_what_the_service_config_refuses(self) -> "Settings":
        """The configuration's own checks, run once here rather than at start-up: the compression's codec and
        shares (CompressionConfig), the tenants' retention (SessionConfig), weights the kernels cannot take and
        the device (WorkerConfig), an exact-copy tier among the tiers built, the lease store's url."""
        self.to_config()
        return self

    def _auth(self) -> str:
        return self.auth or ("api_key" if self.environment == "production" or not _is_loopback_host(self.host) else "none")

    def to_config(self) -> ServiceConfig:
        data_dir = self.data_dir.expanduser()
        tiers = []
        if self.dram_enabled:
            tiers.append(TierConfig("dram", self.dram_budget_mb * MiB, codec=self.dram_codec))
        if self.lmdb_enabled:
            tiers.append(TierConfig("lmdb", self.lmdb_budget_mb * MiB, self.lmdb_path or data_dir / "kv.lmdb",
                                    codec=self.lmdb_codec))
        if self.ssd_enabled:
            tiers.append(TierConfig("ssd", self.ssd_budget_mb * MiB, self.ssd_path or data_dir / "kv-files",
                                    codec=self.ssd_codec))
        if self.redis_enabled:
            tiers.append(TierConfig("redis", self.redis_budget_mb * MiB, url=self.redis_url,
                                    password=_revealed(self.redis_password), key_prefix=self.redis_key_prefix,
                                    secret=self.blob_secret.get_secret_value().encode() if self.blob_secret else None,
                                    ttl_seconds=self.redis_ttl_seconds, chunk_bytes=self.redis_chunk_mb * MiB,
                                    codec=self.redis_codec))
        return ServiceConfig(
            data_dir=data_dir,
            worker=WorkerConfig(
                model=self.model,
                model_cache_dir=(self.model_cache_dir or data_dir / "models").expanduser(),
                device=self.device,
                dtype=self.dtype,
                num_threads=self.torch_threads,
                prefill_chunk_tokens=self.prefill_chunk_tokens,
                keep_freed_memory_warm=self.keep_freed_memory_warm,
                weight_precision=self.weight_precision,
                kv_dtype=self.kv_dtype,
                gemm_rows=self.gemm_rows,
                chat_template=None if self.chat_template is None else self.chat_template.expanduser(),
                tool_call_format=self.tool_call_format,
            ),
            sessions=SessionConfig(
                idle_offload_seconds=self.idle_offload_seconds,
                active_kv_budget_bytes=self.active_kv_budget_mb * MiB,
                max_content_chars=self.max_content_chars,
                max_tokens_limit=self.max_tokens_limit,
                compress_after_seconds=self.compress_after_seconds,
                placement_policy=self.placement_policy,
                exact_copy_tier=self.exact_copy_tier or None,
                tenant_retention=self.tenant_retention,
                trace_file=None if self.trace_file is None else self.trace_file.expanduser(),
                compress_quiet_seconds=self.compress_quiet_seconds,
                compress_chunk_tokens=self.compress_chunk_tokens,
                compress_process=self.compress_process,
                max_concurrent_turns=self.max_concurrent_turns,
                batch_max_sessions=self.batch_max_sessions,
                batch_prefill_tokens=self.batch_prefill_tokens,
                long_prefill_lane=self.long_prefill_lane,
                max_idle_sessions=self.max_idle_sessions,
                max_idle_bytes=self.max_idle_mb * MiB,
                give_back_memory_after_seconds=self.give_back_memory_after_seconds,
                shutdown_seconds=self.shutdown_seconds,
                tenant_limits=TenantLimits(self.tenant_max_sessions, self.tenant_max_stored_mb * MiB,
                                           self.tenant_requests_per_minute, self.tenant_max_concurrent_turns),
                compression=CompressionConfig(
                    self.compression_policy, self.compression_ratio, self.compression_gamma, self.compression_t,
                    self.compression_retain_angle, self.compression_share_keys, self.compression_share_values,
                    self.compression_codec, self.compression_group_size, self.compression_keep,
                    self.compression_scorer, self.compression_budgets, self.compression_merge,
                    self.compression_live_keep,
                ),
            ),
            tiers=tiers,
            promote_on_read=self.promote_on_read,
            restore_planning=self.restore_planning,
            admin_token=_revealed(self.admin_token) or None,  # empty: none (the admin API is off)
            index_secret=self.index_secret.get_secret_value().encode() if self.index_secret else None,
            show_docs=self.environment != "production",
            max_body_bytes=self.max_body_mb * MiB,
            auth=self._auth(),
            allowed_hosts=None if self._auth() != "none" else (
                self.host, *LOOPBACK_NAMES, *(name.strip() for name in self.allowed_hosts.split(",") if name.strip())),
            metrics_public=self.metrics_public,
            metrics_token=_revealed(self.metrics_token),
            history=HistoryConfig(self.history_backend, _revealed(self.postgres_dsn), self.postgres_pool_size,
                                  self.postgres_connect_timeout_seconds),
            lease=None if self.lease_redis_url is None else LeaseConfig(
                self.lease_redis_url, _revealed(self.redis_password), self.redis_key_prefix, self.lease_ttl_ms,
                self.lease_wait_seconds),
        )


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def _is_loopback_host(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _revealed(secret: SecretStr | None) -> str | None:
    """The value inside, for the plain config (whose fields that hold it are left out of its repr)."""
    return None if secret is None else secret.get_secret_value()


def load_settings(env_file: str | Path | None = None, **overrides) -> Settings:
    """Environment variables win over the env file; explicit overrides (CLI flags) win over both."""
    env_file = env_file or os.environ.get("STATEKEEPER_ENV_FILE")
    return Settings(_env_file=env_file, **{k: v for k, v in overrides.items() if v is not None})
