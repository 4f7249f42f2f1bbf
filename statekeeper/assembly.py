"""Wires model, storage and sessions together from a ServiceConfig."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
from pathlib import Path

from statekeeper.compression.transcode import Transcoder
from statekeeper.config import LeaseConfig, ServiceConfig, TierConfig
from statekeeper.coordination import ConversationLeases
from statekeeper.history import HistoryStore, open_history
from statekeeper.profile import load_or_measure
from statekeeper.service_worker import load_service_worker
from statekeeper.sessions import SessionService
from statekeeper.tenancy import KeyStore, PostgresKeyStore
from statekeeper.threads import on_own_thread, use_threads
from statekeeper.worker import ModelWorker
from kernels.device_copy import pinned_host_buffer
from storage.factory import build_tier_manager

log = logging.getLogger(__name__)


def build_service(config: ServiceConfig, worker: ModelWorker | None = None, history: HistoryStore | None = None
                  ) -> SessionService:
    """The session service `config` describes; `worker` and `history`, if given, are used instead of the ones
    it would open."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    use_threads(1)  # this thread runs the event loop; only the model thread runs torch at TORCH_THREADS
    threads = config.worker.num_threads if worker is None else worker.config.num_threads
    kv_dtype = dense_rows = None  # a worker passed in is used as it is
    if worker is None:
        worker, dense_rows, kv_dtype = load_service_worker(config)
    tier_configs = [_with_secret(tier, config.data_dir) for tier in config.tiers]
    # A GPU worker's DRAM tier holds blobs in page-locked memory: its restores copy them to the device in
    # place instead of staging them through the pinned ring first (statekeeper/device_restore.py).
    dram_buffer = pinned_host_buffer if worker.device.type == "cuda" else None
    tiers = build_tier_manager(tier_configs, config.tier_index_path, config.promote_on_read, Transcoder, dram_buffer)
    hardware = None
    if config.restore_planning:  # measured at the model thread's count
        hardware = on_own_thread(threads, load_or_measure, config.profile_dir, worker, tiers.tiers)
    # The key of the index that finds a conversation by its messages (statekeeper/prefix_index.py).
    # Replicas that share a history share its secret (STATEKEEPER_INDEX_SECRET), or none finds the others'.
    index_key = config.index_secret or local_secret(config.data_dir / "index-secret")
    history = history or open_history(config.history, config.history_path, index_key)
    return SessionService(worker, history, tiers, config.sessions, config.profile_dir, hardware,
                          open_keys(config), _leases(config.lease), kv_dtype, dense_rows)


def open_keys(config: ServiceConfig) -> KeyStore | PostgresKeyStore:
    """API keys beside the history: in the data directory, or in the database replicas share."""
    if config.history.backend == "postgres":
        return PostgresKeyStore(config.history.postgres_dsn, config.history.connect_timeout_seconds)
    return KeyStore(config.keys_path)


def _leases(config: LeaseConfig | None) -> ConversationLeases | None:
    if config is None:
        return None
    return ConversationLeases(config.url, config.password, config.key_prefix, config.ttl_ms, config.wait_seconds)


def _with_secret(tier: TierConfig, data_dir: Path) -> TierConfig:
    """A Redis tier without a configured secret (development: production refuses to start without one)
    uses one kept in the data directory, so its blobs outlive a restart; replicas that share the Redis
    need STATEKEEPER_BLOB_SECRET."""
    if tier.name != "redis" or tier.secret is not None:
        return tier
    return dataclasses.replace(tier, secret=local_secret(data_dir / "blob-secret"))


SECRET_BYTES = 32


def local_secret(path: Path) -> bytes:
    """32 random bytes created once, readable by this user only. Written whole before the name appears (a
    second process never reads a file still empty) and synced; a file left empty or short by an older version's
    crash holds no key and is made again (what it keyed, KV blobs and the conversation index, is a cache)."""
    try:
        held = path.read_bytes()
    except FileNotFoundError:
        held = None
    if held is not None and SECRET_BYTES <= len(held) <= hashlib.blake2b.MAX_KEY_SIZE:
        return held
    if held is not None:
        log.warning("%s holds no key (%d bytes): making a new one", path, len(held))
    secret = secrets.token_bytes(SECRET_BYTES)
    draft = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    descriptor = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(secret)
            file.flush()
            os.fsync(file.fileno())
        if held is not None:
            os.replace(draft, path)
        else:
            try:
                os.link(draft, path)  # fails where another process made it first: theirs is used
            except FileExistsError:
                return path.read_bytes()
            except OSError:  # a filesystem without hard links (SMB, vboxsf, some FUSE volumes)
                return _create_exclusively(path, secret)
        _sync_directory(path.parent)
    finally:
        draft.unlink(missing_ok=True)
    return secret


def _create_exclusively(path: Path, secret: bytes) -> bytes:
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process created it first: use theirs
        return path.read_bytes()
    with os.fdopen(descriptor, "wb") as file:
        file.write(secret)
        file.flush()
        os.fsync(file.fileno())
    return secret


def _sync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:  # some filesystems (FUSE) cannot sync a directory: the file itself is synced
        pass
    finally:
        os.close(descriptor)
