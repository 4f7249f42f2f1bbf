"""The model worker as the service runs it (statekeeper/assembly.py builds the service around it; `statekeeper
profile` and `calibrate` measure on it): loaded on the configured device and dtype, with the start-up choices
that change what it computes and its fingerprint."""

from __future__ import annotations

from statekeeper.config import ServiceConfig, WorkerConfig
from statekeeper.dense_rows_choice import choose as choose_dense_rows
from statekeeper.kv_dtype_choice import choose as choose_kv_dtype
from statekeeper.model_loader import load_model
from statekeeper.threads import on_own_thread
from statekeeper.worker import ModelWorker


def load_service_worker(config: ServiceConfig):
    """The model worker as the service runs it, with the start-up choices that change what it computes and its
    fingerprint where restore planning is on: (worker, the dense-rows choice, the KV dtype choice). Loaded at
    TORCH_THREADS in a thread that ends (its OpenMP team goes with it). `statekeeper profile` and `calibrate`
    key what they measure by this worker's fingerprint: one the service never builds is never looked up."""
    threads = config.worker.num_threads
    worker = on_own_thread(threads, _load_worker, config.worker)
    dense_rows = kv_dtype = None
    if config.restore_planning:  # the start-up measurements: the kernels, the KV dtype, then the profile
        dense_rows = on_own_thread(threads, choose_dense_rows, worker, config.profile_dir)
        kv_dtype = on_own_thread(threads, choose_kv_dtype, worker, config.profile_dir, config.worker.kv_dtype)
    return worker, dense_rows, kv_dtype


def _load_worker(config: WorkerConfig) -> ModelWorker:
    return ModelWorker(load_model(config.model, config.model_cache_dir, config.device, config.dtype), config)
