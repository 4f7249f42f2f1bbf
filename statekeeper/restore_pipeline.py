"""The restore pipeline (Krul §6.2): recompute the first r history tokens while a loader copies tokens
[r, N) of every layer from the stored blob, then hand the worker one assembled cache.

Both sides write into the same reserved buffers, in disjoint rows: the compute side through a normal
prefill of r tokens (every layer's rows [0, r)), the loader thread row ranges [r, N) layer by layer.
On a CPU the overlap is real because torch releases the GIL inside the model's kernels and inside
copies. A GPU worker restores through statekeeper/device_restore.py (CUDA streams and events). A load that fails or is late falls back to recomputing
[r, N); a cancelled restore stops both sides. Every restore records a per-layer timeline.

A compressed blob (per-head eviction, int4) is not split (benchmarks/restore_decode.py): its cost is
decoding, not moving bytes. `restore_compressed_layerwise` hides that decode behind the new message's
prefill instead: a loader thread decodes layer l + 1 (int4 decode and scatter, straight into the
reserved cache) while the model prefills layer l, whose forward waits only until its own layer is
written (`waiting_for_layers`)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from scheduler.plan import RestorePlan
from statekeeper.compression import head_budget
from statekeeper.compression.form import StoredForm
from statekeeper.compression.layer_decode import decoded_layer
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


def _write_rows(layer, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A plain copy (torch releases the GIL inside it). A GPU worker restores through
    statekeeper/device_restore.py instead (a copy stream from pinned memory, no host wait); what reaches
    this path on a GPU (`statekeeper profile`, a restore the device restorer passes on) takes synchronous
    copies."""
    layer.write_rows(start, keys, values)


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
        load_started, moved_mb = clock(), 0.0
        try:
            for index, (keys, values) in enumerate(stored):
                if stop.is_set() or cancel.is_set():
                    raise LoadFailed("stopped")
                if keys.shape[1] < n or values.shape[1] < n:
                    raise LoadFailed(f"layer {index} holds {min(keys.shape[1], values.shape[1])} of {n} tokens")
                begin = clock()
                _write_rows(cache.layers[index], r, keys[:, r:n], values[:, r:n])
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
        try:
            with _layer_timer(worker, report.layers, clock):
                worker.prefill(cache, tokens[:r])
                report.compute_ms = clock()
        except BaseException:  # the caller closes the blob's read next: the loader must not be copying out of it
            stop.set()
            if loader.is_alive():
                loader.join()
            raise
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


@dataclass(slots=True)
class LayerwiseReport:
    num_tokens: int  # restored from the blob
    prefill_tokens: int  # prefilled after it
    load_ms: float = 0.0  # from the restore's start (the blob read) to the last layer decoded
    queued_ms: float = 0.0  # from the restore's start until the model thread took it up
    compute_ms: float = 0.0  # from the restore's start to the prefill's end, waits included
    wait_ms: float = 0.0  # what the prefill spent waiting for layers
    total_ms: float = 0.0
    fallback: str | None = None  # why everything was recomputed instead
    layers: list[LayerTimes] = field(default_factory=list)

    def summary(self) -> dict:
        return {"tokens": self.num_tokens, "prefill_tokens": self.prefill_tokens,
                "measured": {"load_ms": round(self.load_ms, 2), "queued_ms": round(self.queued_ms, 2),
                             "compute_ms": round(self.compute_ms, 2),
                             "wait_ms": round(self.wait_ms, 2), "total_ms": round(self.total_ms, 2)},
                "fallback": self.fallback}


@contextmanager
def waiting_for_layers(worker: ModelWorker, ready: list[threading.Event], timeout_s: float | None = None,
                       check=None):
    """Forward pre-hooks on the decoder layers, only inside this block: layer l's forward starts once
    ready[l] is set (LoadFailed if that takes past `timeout_s` from entering the block), then calls
    `check()`, which may raise to abandon the forward. Yields the ms each layer spent waiting."""
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    waited = [0.0] * len(ready)
    handles = []
    for index, module in enumerate(worker.decoder_layers()):
        def before(_module, _args, index=index):
            begin = time.perf_counter()
            if not ready[index].wait(None if deadline is None else max(0.0, deadline - begin)):
                raise LoadFailed(f"layer {index} not loaded within {timeout_s} s")
            waited[index] += (time.perf_counter() - begin) * 1e3
            if check is not None:
                check()

        handles.append(module.register_forward_pre_hook(before))
    try:
        yield waited
    finally:
        for handle in handles:
            handle.remove()


def layerwise_supported(form: StoredForm) -> bool:
    """Blobs whose layers decode independently: head_budget's per-head layout without shared pairs."""
    return form.kind == "heads"


def restore_compressed_layerwise(worker: ModelWorker, tensors: dict[str, torch.Tensor], form: StoredForm,
                                 tokens: list[int], stats=None, cancel: threading.Event | None = None,
                                 load_timeout_s: float = 60.0) -> tuple[KVCache, torch.Tensor, LayerwiseReport]:
    """A per-head compressed blob (`tensors` as serialization.decode_tensors gives them, and its `form`; it
    covers tokens[:form.num_tokens]) restored layer by layer on a loader thread, straight into a cache
    reserved for all of `tokens`, while the model prefills the rest of `tokens` (the new message) with
    `stats`: LayerwiseRestore started and finished at once."""
    return LayerwiseRestore(worker, tensors, form, tokens, cancel, load_timeout_s).finish(stats)


class LayerwiseRestore:
    """Started where the blob is read (an I/O thread): the loader begins decoding at once, so the time a
    turn waits in line for the model thread is decode time, not lost; `finish` then runs on the model
    thread and prefills the new message behind whatever layers are not decoded yet. The result is the
    one restore_state + KVCache.from_layers + worker.prefill gives. A load that fails (tensors that do not
    fit) or is not done `load_timeout_s` after `finish` starts recomputes all of `tokens`; `cancel` stops
    both sides (RestoreCancelled); a prefill abandoned by a failed load may have left a partial forward's
    rows in `stats`. Raises ValueError for a layout it cannot split by layer (`layerwise_supported`). A
    restore that is never finished must be `abandon`ed, which stops its loader."""

    def __init__(self, worker: ModelWorker, tensors: dict[str, torch.Tensor], form: StoredForm, tokens: list[int],
                 cancel: threading.Event | None = None, load_timeout_s: float = 60.0):
        num_tokens, num_layers = form.num_tokens or 0, worker.num_layers
        if not layerwise_supported(form):
            raise ValueError("only per-head layouts without shared pairs restore layer by layer")
        if not 0 < num_tokens < len(tokens):
            raise ValueError("the blob must cover a prefix of the tokens, with tokens after it to prefill")
        self.worker, self.tokens, self.num_tokens, self.load_timeout_s = worker, tokens, num_tokens, load_timeout_s
        self._started = time.perf_counter()
        self.report = LayerwiseReport(num_tokens, len(tokens) - num_tokens,
                                      layers=[LayerTimes() for _ in range(num_layers)])
        self.cancel, self._stop, self._failure = cancel or threading.Event(), threading.Event(), []
        self._ready = [threading.Event() for _ in range(num_layers)]
        self.cache = worker.new_cache()
        empty = torch.empty(worker.num_kv_heads, 0, worker.head_dim, dtype=worker.kv_dtype, device=worker.device)
        self.cache.reserve(len(tokens), [(empty, empty)] * num_layers)
        self.cache.set_length(num_tokens)  # the prefill appends after the history the loader writes
        try:
            # Cheap (no K/V), and the attention's bias buffers are built before the first layer runs.
            self.cache.head_bias = [b.to(worker.device) for b in head_budget.restore_bias(tensors, num_tokens, num_layers)]
        except (KeyError, ValueError, RuntimeError, IndexError) as exc:  # recomputed in finish, as a failed load is
            self._failure.append(exc)
        self._loader = threading.Thread(target=self._load, args=(tensors, form), name="statekeeper-layerwise-loader",
                                        daemon=True)
        if not self._failure:
            self._loader.start()

    def _clock(self) -> float:
        return (time.perf_counter() - self._started) * 1e3

    def _load(self, tensors: dict[str, torch.Tensor], form: StoredForm) -> None:
        try:
            with torch.inference_mode():
                for index, times in enumerate(self.report.layers):
                    if self._stop.is_set() or self.cancel.is_set():
                        raise LoadFailed("stopped")
                    begin = self._clock()
                    keys, values = self.cache.layers[index].zeroed_rows(self.num_tokens)
                    head_budget.scatter_layer(decoded_layer(tensors, form, index), index, keys, values)
                    times.load = (begin, self._clock())
                    self._ready[index].set()
        except BaseException as exc:  # handed to the compute side, which recomputes instead
            self._failure.append(exc)
        finally:
            for event in self._ready:  # never leave the prefill waiting
                event.set()

    def _check(self) -> None:
        if self.cancel.is_set():
            raise RestoreCancelled("restore cancelled")
        if self._failure:
            raise LoadFailed("the load failed")

    def abandon(self) -> None:
        """Stops the loader (a no-op once finished)."""
        self._stop.set()
        if self._loader.is_alive():
            self._loader.join()

    def loaded(self) -> tuple[KVCache, LayerwiseReport]:
        """Off the model thread, instead of `finish`: waits for every layer (at most `load_timeout_s`) and
        returns the cache covering the blob's tokens, for the prompt to be prefilled as any turn's is.
        LoadFailed if a layer did not load; RestoreCancelled if cancelled."""
        if self._loader.ident is not None:  # started: a bias that did not fit never starts it
            self._loader.join(self.load_timeout_s)
        if self._loader.is_alive():
            self.abandon()
            raise LoadFailed(f"layers not loaded within {self.load_timeout_s} s")
        self._check()
        loads = [t.load for t in self.report.layers if t.load is not None]
        self.report.load_ms = loads[-1][1] if loads else 0.0
        self.report.total_ms = self._clock()
        return self.cache, self.report

    def finish(self, stats=None) -> tuple[KVCache, torch.Tensor, LayerwiseReport]:
        """On the model thread: the cache, the prefill's logits (as worker.prefill) and the timeline."""
        worker, tokens, report = self.worker, self.tokens, self.report
        report.queued_ms = self._clock()
        logits = None
        if not self._failure:
            try:
                # The wait hooks first: a layer's compute span starts once its rows are there.
                with waiting_for_layers(worker, self._ready, self.load_timeout_s, self._check) as waited, \
                        _layer_timer(worker, report.layers, self._clock):
                    logits = worker.prefill(self.cache, tokens[self.num_tokens:], stats)
                report.compute_ms, report.wait_ms = self._clock(), sum(waited)
            except LoadFailed as exc:
                self._failure.append(exc)  # after the loader's own failure, if it had one
            finally:
                self.abandon()
        loads = [t.load for t in report.layers if t.load is not None]
        report.load_ms = loads[-1][1] if loads else 0.0
        if self.cancel.is_set():
            raise RestoreCancelled("restore cancelled")
        cache = self.cache
        if self._failure:
            report.fallback = f"{type(self._failure[0]).__name__}: {self._failure[0]}"
            cache = worker.new_cache()
            logits = worker.prefill(cache, tokens, stats)
        report.total_ms = self._clock()
        return cache, logits, report
