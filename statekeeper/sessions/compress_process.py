"""Compression on the other core: a child process with its own copy of the model scores, evicts and
encodes stored exact blobs, so the model thread that serves turns does none of that work.

Why a process: with the scoring as background jobs on the model thread, six concurrent users waited
behind it (issue 13: p95 TTFT 1.36x lossless with compression running, BENCHMARKS.md "Many users at
once"), while the machine's second core sat mostly idle. A thread would share the interpreter lock
with the model thread's many small ops; a process shares only the memory bus.

The protocol carries no pickle: each message is bytes over a multiprocessing pipe, a JSON header then,
where there is one, a blob in the storage format (storage/serialization.py). Parent -> child: a job
(`tokens`, `compression` as CompressionConfig fields), then the exact blob; or
`{"stop": true}`. Child -> parent: `{"stored", "cancelled", "error", "cpu_seconds"}`, then the
compressed blob when `stored`. A shared event cancels the running job between scoring chunks."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from statekeeper.compression import from_config as compressor_from_config
from statekeeper.compression import layer_tensors, restore_state
from statekeeper.config import CompressionConfig, WorkerConfig
from statekeeper.kv_cache import KVCache
from statekeeper.kv_dtype_choice import dtype_name
from statekeeper.sessions.restore import stored_form
from statekeeper.worker import ModelWorker
from storage import serialization

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # importing torch and loading the model in the child
CLOSE_GRACE_S = 1.0  # a cancelled job's time to stop at shutdown before the child is killed


class CompressionCancelled(Exception):
    pass


def runs_in_child(config: CompressionConfig) -> bool:
    """Compressions that need nothing but the stored KV: no statistics of the conversation's own turns
    (Krul's sharing and the expected/snapkv scorers read them) and no calibrated profile. The service
    default (KVzip scores, adaptive budgets, int4) is one."""
    if config.policy == "none":
        return True
    return config.policy == "heads" and config.scorer == "kvzip" and config.budgets != "calibrated"


def compress_exact_blob(worker: ModelWorker, blob, tokens: list[int], config: CompressionConfig,
                        is_cancelled=lambda: False) -> bytearray | None:
    """`blob` (an exact stored state of `tokens`' prefix) compressed as `config` asks; None when there
    is nothing to do (already compressed, empty, or lossless). Scoring runs in the worker's prefill
    chunks; raises CompressionCancelled between them once `is_cancelled()`; BlobError for a blob that is not this model's exact state."""
    compressor = compressor_from_config(config)
    header, tensors = serialization.decode_tensors(blob, worker.fingerprint, tokens)
    form = stored_form(header)
    if compressor is None or header.num_tokens == 0 or form.kind != "exact" or form.codec is not None:
        return None
    layers, bias = restore_state(tensors, form, worker.num_layers)
    cache = KVCache.from_layers(layers, worker.device, bias)
    stats = worker.new_stats()
    if config.policy == "heads":
        collector, steps = worker.reconstruction_plan(cache, tokens)
        try:
            for step in steps:
                if is_cancelled():
                    raise CompressionCancelled
                worker.reconstruction_step(cache, collector, step)
        finally:
            cache.truncate(collector.history_tokens)
        stats.reconstruction = collector.scores
    return encode_compressed(compressor, cache, stats, worker.fingerprint, tokens)


def encode_compressed(compressor, cache: KVCache, stats, fingerprint: str, tokens: list[int]) -> bytearray:
    """`cache` compressed by `compressor` and written as a blob: the last step of both paths (here, and
    on the model thread's side in sessions/offload.py). Raises ValueError when the compressor lacks the
    statistics it needs."""
    compressed = compressor.compress(cache.export_layers(), stats, cache.head_bias)
    stored = compressed.tensors or layer_tensors(cache.export_layers())
    return serialization.encode_tensors(stored, fingerprint, tokens, cache.num_tokens, compressed.meta)


def _run_only_when_idle() -> None:
    """Background work: on Linux the child gets a core only when no thread of the service wants it
    (SCHED_IDLE), so a restore's decode thread or the model thread never waits behind a scoring."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


# WorkerConfig's paths (the model cache, a chat template file): strings in the JSON the child is handed
PATH_SETTINGS = tuple(field.name for field in fields(WorkerConfig) if "Path" in str(field.type))


def _serve(connection, cancel, worker_settings: str) -> None:
    """The child's loop: load the model, announce its fingerprint, then one job at a time."""
    from statekeeper.model_loader import load_model

    _run_only_when_idle()

    settings = json.loads(worker_settings)
    paths = {name: Path(settings[name]) for name in PATH_SETTINGS if settings[name] is not None}
    config = WorkerConfig(**(settings | paths | {"num_threads": 1}))
    worker = ModelWorker(load_model(config.model, config.model_cache_dir, config.device, config.dtype), config)
    connection.send_bytes(json.dumps({"fingerprint": worker.fingerprint}).encode())
    while True:
        try:
            request = json.loads(connection.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if request.get("stop"):
            return
        blob = connection.recv_bytes()
        started, result = time.process_time(), None
        reply = {"stored": False, "cancelled": False, "error": None}
        try:
            result = compress_exact_blob(worker, blob, request["tokens"], CompressionConfig(**request["compression"]),
                                         cancel.is_set)
            reply["stored"] = result is not None
        except CompressionCancelled:
            reply["cancelled"] = True
        except Exception as exc:  # reported to the parent, which keeps the blob exact
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply["cpu_seconds"] = time.process_time() - started
        connection.send_bytes(json.dumps(reply).encode())
        if result is not None:
            connection.send_bytes(result)


@dataclass(slots=True)
class ProcessCounters:
    jobs: int = 0
    cpu_seconds: float = 0.0  # the child's CPU time on jobs (the model thread's time is not spent)
    starts: int = 0


class CompressionProcess:
    """The parent's handle: starts the child on first use (and again after it dies), one job at a time on
    its own thread, so no I/O thread or the event loop waits on the pipe."""

    def __init__(self, worker: ModelWorker):
        # The KV dtype the parent keeps, not the setting: KV_DTYPE=auto is decided by timing at start
        # (statekeeper/kv_dtype_choice.py), and a child that resolved the setting alone could keep another, whose
        # fingerprint the parent refuses (every compression failed so on an AMD EPYC, where float32 measured faster).
        config = replace(worker.config, kv_dtype=dtype_name(worker.kv_dtype))
        settings = asdict(config) | {name: str(getattr(config, name)) for name in PATH_SETTINGS
                                     if getattr(config, name) is not None}
        self._settings = json.dumps(settings)
        self._fingerprint = worker.fingerprint
        self._context = multiprocessing.get_context("spawn")  # never fork a process running torch threads
        self._cancel = self._context.Event()
        self._closing = threading.Event()
        self._process = None
        self._connection = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="statekeeper-compress")
        self.counters = ProcessCounters()
        self.busy = False  # a job is with the child

    async def compress(self, blob: bytes, tokens: list[int], config: CompressionConfig
                       ) -> tuple[bytes | None, float]:
        """`blob` (exact) compressed in the child (None when there was nothing to do), and the CPU seconds the
        child spent on it (the placement policy's measured cost of compressing). Raises
        CompressionCancelled after `cancel()`, RuntimeError when the child failed or died."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._compress, blob, tokens, config)

    def cancel(self) -> None:
        """Stops the running job at its next scoring chunk (a job that starts later clears it)."""
        self._cancel.set()

    def _compress(self, blob: bytes, tokens: list[int], config: CompressionConfig) -> tuple[bytes | None, float]:
        self._ensure_started()
        self._cancel.clear()
        job = {"tokens": tokens, "compression": asdict(config)}
        self.busy = True
        try:
            self._connection.send_bytes(json.dumps(job).encode())
            self._connection.send_bytes(blob)
            reply = json.loads(self._connection.recv_bytes())
            result = self._connection.recv_bytes() if reply["stored"] else None
        except (EOFError, OSError) as exc:
            self._stop_child()
            raise RuntimeError("the compression process died") from exc
        finally:
            self.busy = False
        self.counters.jobs += 1
        self.counters.cpu_seconds += reply["cpu_seconds"]
        if reply["cancelled"]:
            raise CompressionCancelled
        if reply["error"]:
            raise RuntimeError(f"compression process: {reply['error']}")
        return result, reply["cpu_seconds"]

    def _ensure_started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        self._stop_child()
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._cancel, self._settings),
                                              name="statekeeper-compress", daemon=True)
        self._process.start()
        child.close()
        self._connection = parent
        self.counters.starts += 1
        started = time.monotonic()
        while not parent.poll(0.1):  # in steps: a shutdown does not wait for the model to load
            if self._closing.is_set():
                self._stop_child(at_once=True)  # it reads no "stop" before its model is loaded
                raise CompressionCancelled
            if time.monotonic() - started > START_TIMEOUT_S:
                self._stop_child()
                raise RuntimeError("the compression process did not start")
        try:
            ready = json.loads(parent.recv_bytes())
        except (EOFError, OSError) as exc:
            self._stop_child()
            raise RuntimeError("the compression process failed to load the model") from exc
        if ready["fingerprint"] != self._fingerprint:  # its blobs would not restore here
            self._stop_child()
            raise RuntimeError("the compression process loaded a different model")

    def _stop_child(self, at_once: bool = False) -> None:
        if at_once and self._process is not None:
            self._process.kill()
        if self._connection is not None:
            try:
                self._connection.send_bytes(json.dumps({"stop": True}).encode())
            except (OSError, ValueError):
                pass
            self._connection.close()
            self._connection = None
        if self._process is not None:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            self._process = None

    def close(self) -> None:
        """Stops the child: a running job is cancelled (the child sees it at its next scoring chunk) and
        given CLOSE_GRACE_S, then the child is killed; a child still loading is stopped at once. Under
        SCHED_IDLE on a machine with no idle CPU the next chunk may be a long way off, and a shutdown must
        not wait for it: the job's blob stays exact. Closing again does nothing."""
        self._closing.set()
        self.cancel()
        deadline = time.monotonic() + CLOSE_GRACE_S
        while self.busy and time.monotonic() < deadline:
            time.sleep(0.02)
        process = self._process
        if self.busy and process is not None:
            process.kill()  # the job's thread reads EOF and ends
        self._thread.shutdown(wait=True)
        self._stop_child()
