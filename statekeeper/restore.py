"""The restore pipeline (Krul §6.2): recompute the first r history tokens while a loader copies tokens
[r, N) of every layer from the stored blob, then hand the worker one assembled cache.

Both sides write into the same reserved buffers, in disjoint rows: the compute side through a normal
prefill of r tokens (every layer's rows [0, r)), the loader thread row ranges [r, N) layer by layer.
On a CPU the overlap is real because torch releases the GIL inside the model's kernels and inside
copies. (On a GPU the loader would be a CUDA copy stream from pinned host buffers; this CPU path is
the reference it would be tested against.) A load that fails or is late falls back to recomputing
[r, N); a cancelled restore stops both sides. Every restore records a per-layer timeline."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from scheduler.plan import RestorePlan
from statekeeper.kv_cache import KVCache
from statekeeper.worker import ModelWorker

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class LayerTimes:
    load: tuple[float, float] | None = None  # ms since the restore started
    compute: tuple[float, float] | None = None


@dataclass(slots=True)
class RestoreReport:
    plan: RestorePlan
    compute_ms: float = 0.0  # measured T_C: from the restore's start (buffers reserved) to the prefix's end
    load_ms: float = 0.0  # measured T_L: from the restore's start to the last layer loaded
    total_ms: float = 0.0
    fallback: str | None = None  # why the loaded part was recomputed instead
    layers: list[LayerTimes] = field(default_factory=list)

    @property
    def bubble_fraction(self) -> float:
        """Idle time on the critical (longer) side over the restore time."""
        if self.total_ms <= 0:
            return 0.0
        return max(0.0, self.total_ms - max(self.compute_ms, self.load_ms)) / self.total_ms

    def summary(self) -> dict:
        return {
            "recompute_tokens": self.plan.recompute_tokens, "tokens": self.plan.num_tokens,
            "planned": {"compute_ms": round(self.plan.compute_ms, 2), "load_ms": round(self.plan.load_ms, 2),
                        "total_ms": round(self.plan.total_ms, 2)},
            "measured": {"compute_ms": round(self.compute_ms, 2), "load_ms": round(self.load_ms, 2),
                         "total_ms": round(self.total_ms, 2)},
            "bubble_fraction": round(self.bubble_fraction, 4), "fallback": self.fallback,
        }


class LoadFailed(RuntimeError):
    pass


@contextmanager
def _layer_timer(worker: ModelWorker, times: list[LayerTimes], clock):
    """Forward hooks on the decoder layers, only for the duration of the recompute."""
    decoder_layers = worker.decoder_layers()
    handles = []
    for index, module in enumerate(decoder_layers):
        def before(_module, _args, index=index):
            times[index].compute = (clock(), clock())

        def after(_module, _args, _output, index=index):
            start, _ = times[index].compute
            times[index].compute = (start, clock())

        handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _copy_stream(device: torch.device):
    """On a GPU the loader copies on its own CUDA stream, so copies overlap the recompute's kernels."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _write_rows(layer, start: int, keys: torch.Tensor, values: torch.Tensor, stream) -> None:
    if stream is None:  # CPU: a plain copy (torch releases the GIL inside it)
        layer.write_rows(start, keys, values)
        return
    # GPU: from pinned host memory, asynchronously on the copy stream; waited for before the layer counts
    # as loaded. (Untested here: this machine has no GPU; the CPU path above is the reference.)
    with torch.cuda.stream(stream):
        layer.write_rows(start, keys.pin_memory().to(layer.device, non_blocking=True),
                         values.pin_memory().to(layer.device, non_blocking=True))
    stream.synchronize()


class RestoreCancelled(RuntimeError):
    pass


def restore_pipelined(worker: ModelWorker, stored: Layers, tokens: list[int], plan: RestorePlan,
                      throttle_mb_per_s: float | None = None, load_timeout_s: float | None = None,
                      cancel: threading.Event | None = None) -> tuple[KVCache, RestoreReport]:
    """`stored`: per layer (K, V) views of the blob covering tokens [0, N) (rows before r are not read).
    `throttle_mb_per_s` (benchmarks only) caps the loader's bandwidth to stand for a slow tier;
    `load_timeout_s`: a loader still running this long after the recompute ends is abandoned."""
    n, r = plan.num_tokens, plan.recompute_tokens
    started = time.perf_counter()

    def clock() -> float:
        return (time.perf_counter() - started) * 1e3

    report = RestoreReport(plan, layers=[LayerTimes() for _ in stored])
    cancel, stop, failure = cancel or threading.Event(), threading.Event(), []
    cache = worker.new_cache()
    cache.reserve(n, [(k[:, :0].to(worker.device), v[:, :0].to(worker.device)) for k, v in stored])

    def load() -> None:
        copy_stream = _copy_stream(worker.device)
        load_started, moved_mb = clock(), 0.0
        try:
            for index, (keys, values) in enumerate(stored):
                if stop.is_set() or cancel.is_set():
                    raise LoadFailed("stopped")
                if keys.shape[1] < n or values.shape[1] < n:
                    raise LoadFailed(f"layer {index} holds {min(keys.shape[1], values.shape[1])} of {n} tokens")
                begin = clock()
                _write_rows(cache.layers[index], r, keys[:, r:n], values[:, r:n], copy_stream)
                if throttle_mb_per_s:
                    # Paced against the whole load's schedule, as a link of that bandwidth delivers: a late
                    # wake-up (the GIL, the OS) is made up on the next layer instead of adding up.
                    moved_mb += (keys[:, r:n].nbytes + values[:, r:n].nbytes) / 1e6
                    due_ms = load_started + moved_mb / throttle_mb_per_s * 1e3
                    time.sleep(max(0.0, (due_ms - clock()) / 1e3))
                report.layers[index].load = (begin, clock())
        except BaseException as exc:  # handed to the compute side, which recomputes instead
            failure.append(exc)

    loader = threading.Thread(target=load, name="statekeeper-restore-loader", daemon=True)
    if r == 0:
        load()  # nothing to overlap with: no thread
    elif r < n:
        loader.start()
    if r > 0:
        with _layer_timer(worker, report.layers, clock):
            worker.prefill(cache, tokens[:r])
            report.compute_ms = clock()
    if 0 < r < n:
        loader.join(load_timeout_s)
        if loader.is_alive():
            stop.set()
            loader.join()
            failure[:] = [LoadFailed(f"load still running {load_timeout_s} s after the recompute")]
    if r < n:
        loads = [t.load for t in report.layers if t.load is not None]
        report.load_ms = loads[-1][1] if loads else 0.0  # both streams are timed from the restore's start
    if cancel.is_set():
        raise RestoreCancelled("restore cancelled")
    if failure:
        report.fallback = f"{type(failure[0]).__name__}: {failure[0]}"
        cache.set_length(r)
        worker.prefill(cache, tokens[r:n])
    else:
        cache.set_length(n)
    report.total_ms = clock()
    return cache, report
