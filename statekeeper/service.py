"""Wires model, storage and sessions together from a ServiceConfig."""

from __future__ import annotations

from statekeeper.compression.transcode import Transcoder
from statekeeper.config import ServiceConfig
from statekeeper.history import HistoryStore
from statekeeper.model_loader import load_model
from statekeeper.profile import load_or_measure
from statekeeper.sessions import SessionService
from statekeeper.worker import ModelWorker
from storage.factory import build_tier_manager


def build_service(config: ServiceConfig, worker: ModelWorker | None = None) -> SessionService:
    config.data_dir.mkdir(parents=True, exist_ok=True)
    if worker is None:
        w = config.worker
        worker = ModelWorker(load_model(w.model, w.model_cache_dir, w.device, w.dtype), w)
    tiers = build_tier_manager(config.tiers, config.tier_index_path, config.promote_on_read, Transcoder)
    hardware = load_or_measure(config.profile_dir, worker, tiers.tiers) if config.restore_planning else None
    return SessionService(worker, HistoryStore(config.history_path), tiers, config.sessions, config.profile_dir,
                          hardware)
