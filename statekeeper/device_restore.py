"""The GPU restore (Krul §6 on CUDA streams): a stored conversation's KV goes from host memory to the
device on a copy stream while the compute stream works, and the host never waits for either.

- Copies: each layer's K and V rows [r, N) go by one 2D copy each (kernels/device_copy.py) from pinned
  host memory straight into the reserved cache; a source that is not pinned (an LMDB or SSD memory map, a
  Redis reply) is first copied once into a pinned ring allocated at start (scheduler/staging.py plans it).
  A compressed blob travels as stored: a group of layers' codes, scales and kept-row bits in one copy,
  decoded on the device (compression/layer_decode.py), so a blob 8x smaller moves 8x fewer bytes over PCIe.
- Events: the copy stream records one event per layer (per group of layers for a compressed blob,
  scheduler/staging.py's schedule); the compute stream recomputes the planned prefix [0, r) without
  waiting (its rows are its own), then runs the new message, whose layer l waits for its layer's event
  only (a forward pre-hook, installed only inside the restore): layer l computes while later layers copy.
- Queued inline by default (copies first, then the forwards, one host thread) or by a copier thread beside
  the model thread (`copier=`); BENCHMARKS.md, issue 34, measures both.
- No host synchronisation inside a restore: the host queues copies, decodes and forwards and returns; the
  timings are read from the events afterwards (`DeviceRestoreReport.timeline`).

On a CPU the same code runs without streams or events (copies in order, synchronously): the reference the
GPU suite compares against, tested in `make test`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kernels.device_copy import copy_rows
from kernels.quant import rotation
from scheduler.staging import DEFAULT_SLOTS, layer_groups, plan_staging, ring_shape, schedule_layers
from statekeeper.compression.codec import ROTATION_SEED
from statekeeper.compression.form import StoredForm
from statekeeper.compression.layer_decode import (batchable, check_layers, decode_layer_into, decode_layers_into,
                                                  group_plan, layer_names)
from statekeeper.kv_cache import KVCache
from statekeeper.restore_pipeline import LoadFailed
from statekeeper.worker import ModelWorker

Layers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(slots=True)
class DeviceRestoreReport:
    num_tokens: int  # history restored
    recompute_tokens: int  # of it, recomputed (the prefix)
    message_tokens: int  # prefilled after it
    compressed: bool = False
    copied_bytes: int = 0  # host-to-device
    copy_calls: int = 0
    staged_bytes: int = 0  # copied into the pinned ring first
    reused_slots: int = 0  # staged copies planned into a slot an earlier copy of this restore used
    host_waits: int = 0  # of those (and of slots an earlier restore used), the ones still being read: waited for
    enqueue_ms: float = 0.0  # host time to queue the whole restore
    fallback: str | None = None  # why everything was recomputed instead
    events: dict = field(default_factory=dict)  # "start", "end", "layer<i>" (the last layer of each copy)
    # Host memory the copies read: held until they have run (cupy's copies are unknown to torch's allocator).
    sources: list = field(default_factory=list)

    def timeline(self) -> dict:
        """Milliseconds from the restore's start, read from the events (this waits for the restore's end:
        call it after the turn's first token, never inside the restore)."""
        if not self.events:
            return {}
        end = self.events["end"]
        end.synchronize()
        start = self.events["start"]
        layers = sorted((int(name[5:]), event) for name, event in self.events.items() if name.startswith("layer"))
        result = {"total_ms": start.elapsed_time(end),
                  "copy_ms": start.elapsed_time(layers[-1][1]) if layers else 0.0,
                  "layer_copy_ms": [start.elapsed_time(event) for _, event in layers]}
        self.sources.clear()
        return result

    def summary(self) -> dict:
        return {"tokens": self.num_tokens, "recompute_tokens": self.recompute_tokens,
                "message_tokens": self.message_tokens, "compressed": self.compressed,
                "copied_bytes": self.copied_bytes, "copy_calls": self.copy_calls, "staged_bytes": self.staged_bytes,
                "reused_slots": self.reused_slots, "host_waits": self.host_waits, "enqueue_ms": round(self.enqueue_ms, 3), "fallback": self.fallback}


class PinnedRing:
    """Pinned host buffers allocated once, reused by every restore as scheduler/staging.py plans; remembers
    the event of the last copy out of each slot, so a later restore reuses a slot only after it left."""

    def __init__(self, slot_bytes: int, num_slots: int, pinned: bool):
        self.slot_bytes = slot_bytes
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=pinned) for _ in range(num_slots)]
        self.last_event: list = [None] * num_slots

    @classmethod
    def for_copies(cls, copy_sizes: list[int], pinned: bool, num_slots: int = DEFAULT_SLOTS) -> "PinnedRing":
        return cls(*ring_shape(copy_sizes, num_slots), pinned)



class _Stager:
    """One restore's use of the ring: places its copies in order and makes the host wait where a slot is
    still being read by an earlier copy (counted in the report)."""

    def __init__(self, ring: PinnedRing | None, sizes: list[int], report: DeviceRestoreReport):
        self.ring, self.report = ring, report
        try:
            self.placed = plan_staging(sizes, ring.slot_bytes, len(ring.slots)) if ring is not None and sizes else []
        except ValueError as exc:
            raise RingTooSmall(str(exc)) from None
        self.events: list = []  # per staged copy, once queued
        self.first_use = set()

    def stage(self, source: torch.Tensor) -> torch.Tensor:
        """`source` copied into the ring (a pinned contiguous copy); the caller queues its copy and then `left`."""
        staged = self.space(source.nbytes).view(source.dtype).view(source.shape)
        staged.copy_(source)
        return staged

    def space(self, nbytes: int) -> torch.Tensor:
        """The next placed copy's bytes in the ring, once no earlier copy still reads them; the caller fills
        them, queues its copy and then calls `left`."""
        copy = self.placed[len(self.events)]
        if copy.nbytes != nbytes:
            raise ValueError(f"staged {nbytes} bytes where {copy.nbytes} were planned")
        waits_for = self.events[copy.after] if copy.after is not None else None
        self.report.reused_slots += copy.after is not None
        if waits_for is None and copy.slot not in self.first_use:  # an earlier restore's copy out of the slot
            waits_for = self.ring.last_event[copy.slot]
        self.first_use.add(copy.slot)
        if waits_for is not None and not waits_for.query():
            self.report.host_waits += 1
            waits_for.synchronize()
        self.report.staged_bytes += nbytes
        return self.ring.slots[copy.slot][copy.offset: copy.offset + nbytes]

    def left(self, stream) -> None:
        """Marks the last staged copy as queued on `stream`."""
        event = torch.cuda.Event()
        event.record(stream)
        self.events.append(event)
        self.ring.last_event[self.placed[len(self.events) - 1].slot] = event


class RingTooSmall(ValueError):
    """A copy larger than a slot of the pinned ring: the restore cannot be staged (nothing was queued). Not
    the blob's fault: the caller restores it another way."""


@contextmanager
def waiting_for_events(worker: ModelWorker, ready: list[threading.Event], events: list, failure: list):
    """Inside this block, layer l's forward first waits on the host until the copier has queued layer l's
    copies (ready[l]: normally long done), then makes the compute stream wait for events[l] (a GPU wait:
    the host goes on queueing). LoadFailed if the copier failed."""
    handles = []
    for index, module in enumerate(worker.decoder_layers()):
        def before(_module, _args, index=index):
            ready[index].wait()
            if failure:
                raise LoadFailed(f"{type(failure[0]).__name__}: {failure[0]}")
            torch.cuda.current_stream(worker.device).wait_event(events[index])

        handles.append(module.register_forward_pre_hook(before))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# A compressed restore decodes its layers in this many groups, each one copy and a few kernels for all its
# layers: the message's forward waits for the first group only, and a GPU launches tens of kernels per group
# instead of tens per layer (decoding layer by layer launched ~1,500 kernels for 30 layers, 40 ms on an
# H100's host: BENCHMARKS.md, issue 34). The count does not depend on the machine: it trades the first
# group's decode (the forward's wait) against launches.
COMPRESSED_GROUPS = 4
# History tokens the service's pinned ring holds without reusing a slot (DeviceRestorer.for_worker): pinned
# memory is taken from the host for good, so it is sized for common conversations, not the longest.
RING_TOKENS = 16384


class DeviceRestorer:
    """The worker's restores into device memory: its copy stream, its pinned ring and, where chosen, a copier
    thread that queues the copies (and a compressed blob's decode) while the model thread queues the
    forwards. One per worker, used from the model thread only. On a CPU worker: the synchronous reference,
    in order, no stream, ring or thread."""

    def __init__(self, worker: ModelWorker, ring: PinnedRing | None = None, compressed_groups: int = COMPRESSED_GROUPS,
                 copier: str = "inline"):
        """`copier`: "inline" queues the copies (and a compressed blob's decode) first on the model thread;
        "thread" queues them on a copier thread while the model thread queues the forward, which shares the
        GIL with it. On an H100 inline was faster for SmolLM2's shape at 1k-16k tokens (1.05-1.16x hot
        against 1.15-1.27x) and within 3% for Llama 8B's (BENCHMARKS.md, issue 34)."""
        if copier not in ("thread", "inline"):
            raise ValueError("copier: thread or inline")
        self.worker = worker
        self.on_gpu = worker.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(worker.device) if self.on_gpu else None
        self.ring = ring
        self.profile = None  # the device's DeviceProfile, where measured: plans the split of exact restores
        self.compressed_groups = compressed_groups
        # (an event past its copies, the host memory they read) of restores whose copies may still run: a blob
        # copied in place (a pinned DRAM tier's) stays referenced here until then, whatever its caller drops.
        self._in_flight: list[tuple[torch.cuda.Event, list]] = []
        threaded = self.on_gpu and copier == "thread"
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="statekeeper-copier") if threaded else None
        head_dim = worker.head_dim
        if self.on_gpu and head_dim & (head_dim - 1) == 0:  # -rot blobs: the codec's rotation, copied once now
            rotation(head_dim, ROTATION_SEED, worker.device)

    @classmethod
    def for_worker(cls, worker: ModelWorker, profile=None, ring_tokens: int = RING_TOKENS) -> "DeviceRestorer":
        """The service's: a pinned ring that stages a restore of `ring_tokens` (or the model's context, if
        shorter) without a host wait (longer restores reuse its slots as they free up), and the device's
        profile (statekeeper/device_profile.py) its restores are planned with."""
        tokens = min(ring_tokens, worker.context_length)
        per_copy = worker.kv_bytes_per_token * tokens // (2 * worker.num_layers)
        ring = PinnedRing.for_copies([per_copy] * 2 * worker.num_layers, worker.device.type == "cuda")
        restorer = cls(worker, ring)
        restorer.profile = profile
        return restorer

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown()

    def _event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=True) if self.on_gpu else None

    def _reserved(self, total_tokens: int) -> KVCache:
        worker = self.worker
        cache = worker.new_cache()
        empty = torch.empty(worker.num_kv_heads, 0, worker.head_dim, dtype=worker.kv_dtype, device=worker.device)
        cache.reserve(total_tokens, [(empty, empty)] * worker.num_layers)
        return cache

    def _run(self, report: DeviceRestoreReport, work, cache: KVCache, history: list[int], message: list[int],
             recompute: int, events: list, ready: list[threading.Event], stats=None):
        """Queues `work()` (the copies and decodes: first on this thread, or on the copier thread) and the
        compute stream's part: the prefix recomputed without waiting (its rows are its own), then the message
        behind each layer's event. Anything that fails recomputes the whole history instead (fallback)."""
        worker, failure = self.worker, []
        if self.on_gpu:
            compute = torch.cuda.current_stream(worker.device)
            report.events["start"] = self._event()
            report.events["start"].record(compute)
            self.copy_stream.wait_stream(compute)  # the cache's buffers (and anything queued before) first

        def copies() -> None:
            try:
                if self.on_gpu:
                    with torch.cuda.device(worker.device), torch.cuda.stream(self.copy_stream), torch.inference_mode():
                        work()
                else:
                    work()
            except BaseException as exc:  # handed to the compute side, which recomputes instead
                failure.append(exc)
            finally:
                for event in ready:  # never leave the forward waiting
                    event.set()

        queued = self._copier.submit(copies) if self._copier is not None else copies()
        logits = None
        try:
            if recompute:
                logits = worker.prefill(cache, history[:recompute])
            cache.set_length(len(history))
            if not self.on_gpu:
                if failure:
                    raise LoadFailed(str(failure[0]))
                if message:
                    logits = worker.prefill(cache, message, stats)
            elif message:
                with waiting_for_events(worker, ready, events, failure):
                    logits = worker.prefill(cache, message, stats)
            else:
                for index, event in enumerate(events):
                    ready[index].wait()
                    compute.wait_event(event)
        except LoadFailed:
            pass
        finally:
            if queued is not None:
                queued.result()  # the copier has queued everything (the device may still be running it)
            if self.on_gpu:  # a GPU wait: nothing freed below (a failed restore's cache) is still being written
                compute.wait_stream(self.copy_stream)
                copied = torch.cuda.Event()
                copied.record(compute)
                self._hold(copied, report.sources)
        if failure:
            report.fallback = f"{type(failure[0]).__name__}: {failure[0]}"
            cache = worker.new_cache()
            logits = worker.prefill(cache, history + message, stats)
        elif not message:
            logits = None  # the prefix's logits are not the history's
        if self.on_gpu:
            report.events["end"] = self._event()
            report.events["end"].record(torch.cuda.current_stream(worker.device))
        return cache, logits

    def _hold(self, copied: torch.cuda.Event, sources: list) -> None:
        """Keeps `sources` (host memory a restore's copies read) referenced until `copied` has passed, and
        lets go of earlier restores' whose copies have run."""
        self._in_flight = [(event, held) for event, held in self._in_flight if not event.query()]
        self._in_flight.append((copied, list(sources)))

    @torch.inference_mode()
    def restore_exact(self, stored: Layers, history: list[int], message: list[int], recompute_tokens: int = 0,
                      stats=None) -> tuple[KVCache, torch.Tensor | None, DeviceRestoreReport]:
        """`stored`: per layer (K, V) [heads, >= N, dim] on the host covering `history` (N tokens). Rows
        [r, N) are copied, [0, r) recomputed, then `message` prefilled; returns the cache, the logits after
        the message's last token (None without a message) and the report. Pinned sources are copied from
        where they are: the caller keeps them (or the report) until the restore's end event has passed. `stats`: the message's attention
        statistics (the prefix's are not gathered)."""
        n, r, worker = len(history), recompute_tokens, self.worker
        if not 0 <= r <= n:
            raise ValueError("the recomputed prefix must lie within the history")
        if len(stored) != worker.num_layers or any(k.shape[1] < n or v.shape[1] < n for k, v in stored):
            raise ValueError("the stored layers do not cover the history")
        started = time.perf_counter()
        report = DeviceRestoreReport(n, r, len(message))
        cache = self._reserved(n + len(message))
        sources = [[rows[:, r:n] for rows in pair] for pair in stored]
        staged = [[self.on_gpu and not source.is_pinned() for source in pair] for pair in sources]
        sizes = [source.nbytes for pair, flags in zip(sources, staged) for source, flag in zip(pair, flags) if flag]
        if sizes and self.ring is None:
            raise ValueError("a stored state outside pinned memory needs a staging ring")
        stager = _Stager(self.ring, sizes, report)
        schedule = schedule_layers(worker.num_layers, n, r)
        recorded = [self._event() for _ in schedule]
        events = [recorded[entry.message_waits_for] for entry in schedule]
        ready = [threading.Event() for _ in stored]

        def work() -> None:
            for index, (layer, entry) in enumerate(zip(cache.layers, schedule)):
                for source, target, stage in zip(sources[index], layer.reserved_rows(*entry.copy_rows), staged[index]):
                    if stage:
                        source = stager.stage(source)
                    report.copy_calls += copy_rows(target, source, self.copy_stream)
                    report.copied_bytes += source.nbytes
                    report.sources.append(source)
                    if stage:
                        stager.left(self.copy_stream)
                if self.on_gpu:
                    recorded[entry.event].record(self.copy_stream)
                    report.events[f"layer{index}"] = recorded[entry.event]
                ready[index].set()

        cache, logits = self._run(report, work, cache, history, message, r, events, ready, stats)
        report.enqueue_ms = (time.perf_counter() - started) * 1e3
        return cache, logits, report

    @torch.inference_mode()
    def restore_compressed(self, tensors: dict[str, torch.Tensor], form: StoredForm, history: list[int],
                           message: list[int], stats=None) -> tuple[KVCache, torch.Tensor | None, DeviceRestoreReport]:
        """A per-head compressed blob (`tensors` as serialization.decode_tensors gives them, on the host;
        its `form` covers `history`) copied as stored and decoded on the device in groups of layers
        (COMPRESSED_GROUPS), the message's forward following behind each group. A blob that does not fit
        (ValueError from the host's checks, before anything is queued) recomputes everything: fallback."""
        worker, n = self.worker, len(history)
        started = time.perf_counter()
        report = DeviceRestoreReport(n, 0, len(message), compressed=True)
        if form.kind != "heads" or form.num_tokens != n:
            raise ValueError("only a per-head compressed blob covering the history restores this way")
        if self.on_gpu and self.ring is None:
            raise ValueError("a compressed restore packs its layers into the staging ring")
        try:
            counts = check_layers(tensors, form, worker.num_layers, worker.num_kv_heads)
        except (KeyError, ValueError, RuntimeError, IndexError) as exc:
            report.fallback = f"{type(exc).__name__}: {exc}"
            cache = worker.new_cache()
            logits = worker.prefill(cache, history + message, stats)
            report.enqueue_ms = (time.perf_counter() - started) * 1e3
            return cache, logits, report
        cache = worker.new_cache()
        keys, values = cache.reserve_stacked(n + len(message), worker.num_kv_heads, worker.head_dim, worker.kv_dtype,
                                             worker.device)
        biases, buffers = cache.reserve_bias(worker.num_kv_heads, n, n + len(message), worker.kv_dtype, worker.device)
        groups, batched, parts, layouts = self._grouped(tensors, form)
        # A group whose bytes all lie in pinned memory (a pinned DRAM tier's blob) is copied from there.
        in_place = [self.on_gpu and all(block.is_pinned() for block, _ in layout[0]) for layout in layouts]
        stager = _Stager(self.ring, [layout[2] for layout, put in zip(layouts, in_place) if not put]
                         if self.on_gpu else [], report)
        group_events = [self._event() for _ in groups]
        events = [group_events[entry.message_waits_for] for entry in schedule_layers(worker.num_layers, n, 0, groups)]
        ready = [threading.Event() for _ in range(worker.num_layers)]

        def work() -> None:
            for number, group in enumerate(groups):
                on_device = self._to_device(parts[number], layouts[number], stager, report, in_place[number])
                if batched[number]:
                    decode_layers_into(on_device, form, group, counts, keys, values, biases, buffers)
                else:
                    for index in group:
                        keys[index, :, :n].zero_()
                        values[index, :, :n].zero_()
                        decode_layer_into(on_device, form, index, counts[index], keys[index, :, :n],
                                          values[index, :, :n], biases[index], buffers[index])
                if self.on_gpu:
                    group_events[number].record(self.copy_stream)
                    report.events[f"layer{group[-1]}"] = group_events[number]
                for index in group:
                    ready[index].set()

        cache, logits = self._run(report, work, cache, history, message, 0, events, ready, stats)
        report.enqueue_ms = (time.perf_counter() - started) * 1e3
        return cache, logits, report

    def _grouped(self, tensors: dict[str, torch.Tensor], form: StoredForm):
        """(groups of layers, whether each decodes as one, each one's tensors with its decode plan, and their
        layouts in one copy): `compressed_groups` groups, more where a group would not fit a ring slot."""
        storages = {tensor.untyped_storage().data_ptr(): tensor for tensor in tensors.values() if tensor.numel()}
        pinned = self.on_gpu and all(tensor.is_pinned() for tensor in storages.values())  # one blob: one check
        slot_bytes = self.ring.slot_bytes if self.on_gpu and not pinned else None
        for count in range(min(self.compressed_groups, self.worker.num_layers), self.worker.num_layers + 1):
            groups = layer_groups(self.worker.num_layers, count)
            batched = [batchable(tensors, form, group) for group in groups]
            plans = [group_plan(tensors, form, group) if together else {} for group, together in zip(groups, batched)]
            if pinned:  # the plan's few numbers travel in place too
                plans = [{name: numbers.pin_memory() for name, numbers in plan.items()} for plan in plans]
            parts = [{name: tensors[name] for index in group for name in layer_names(tensors, index)} | plan
                     for group, plan in zip(groups, plans)]
            layouts = [_layout(part) for part in parts]
            if slot_bytes is None or all(layout[2] <= slot_bytes for layout in layouts):
                break
        return groups, batched, parts, layouts

    def _to_device(self, tensors: dict[str, torch.Tensor], layout, stager: _Stager, report: DeviceRestoreReport,
                   in_place: bool = False) -> dict[str, torch.Tensor]:
        """Stored tensors on the device in one buffer: packed (`_layout`) into a ring slot and copied in one
        call, or (`in_place`: every block pinned) each block copied from where it lies; viewed there by name.
        On a CPU the same packing into a plain buffer, viewed there (no copy to make)."""
        blocks, offsets, size = layout
        if in_place:
            device = torch.empty(size, dtype=torch.uint8, device=self.worker.device)
            for block, offset in blocks:
                device[offset: offset + block.numel()].copy_(block, non_blocking=True)
                report.sources.append(block)  # held until the copy has run (_in_flight)
                report.copy_calls += 1
                report.copied_bytes += block.numel()
            return self._views(tensors, offsets, device)
        host = stager.space(size) if self.on_gpu else torch.empty(size, dtype=torch.uint8)
        for block, offset in blocks:
            host[offset: offset + block.numel()].copy_(block)
        device = host
        if self.on_gpu:
            device = torch.empty(size, dtype=torch.uint8, device=self.worker.device)
            device.copy_(host, non_blocking=True)
            stager.left(self.copy_stream)
            report.copy_calls += 1
            report.copied_bytes += size
        return self._views(tensors, offsets, device)

    @staticmethod
    def _views(tensors: dict[str, torch.Tensor], offsets: dict[str, int], device: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: device[offsets[name]: offsets[name] + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
                for name, tensor in tensors.items()}


_TENSOR_ALIGNMENT = 64  # bytes: as the blob format aligns them (storage/serialization.py)


def _aligned(size: int) -> int:
    return -(-size // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT


def _follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Whether `after` starts where `before` ends (within the blob format's alignment) in the same memory."""
    if not before.numel() or not after.numel():
        return False
    if before.untyped_storage().data_ptr() != after.untyped_storage().data_ptr():
        return False
    gap = after.data_ptr() - (before.data_ptr() + before.nbytes)
    return 0 <= gap < _TENSOR_ALIGNMENT


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[torch.Tensor, int]], dict[str, int], int]:
    """How a group's tensors pack into one buffer: (blocks of bytes to copy in, at their offsets; each
    tensor's offset; the size). Tensors lying back to back in a blob's memory (a group's layers, as
    serialization.decode_tensors gives them) move as one block, so staging a group is one host copy; the
    others one by one, each 64-byte aligned."""
    items, blocks, offsets, size = list(tensors.items()), [], {}, 0
    start = 0
    while start < len(items):
        end = start + 1
        while end < len(items) and _follows(items[end - 1][1], items[end][1]):
            end += 1
        run, size = items[start:end], _aligned(size)
        first, last = run[0][1], run[-1][1]
        if first.numel():
            begin = first.data_ptr()
            storage = first.untyped_storage()
            span = last.data_ptr() + last.nbytes - begin
            if len(run) == 1:
                blocks.append((first.contiguous().reshape(-1).view(torch.uint8), size))
            else:
                block = torch.empty(0, dtype=torch.uint8).set_(storage, begin - storage.data_ptr(), (span,))
                blocks.append((block, size))
            for name, tensor in run:
                offsets[name] = size + tensor.data_ptr() - begin
            size += span
        else:
            offsets[run[0][0]] = size
        start = end
    return blocks, offsets, max(_aligned(size), _TENSOR_ALIGNMENT)
