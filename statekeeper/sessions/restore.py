"""Stored blob -> KV cache: validated, planned (Krul §6's recompute/load split for plain blobs), and
never used when anything about it is wrong (the turn then recomputes from the history)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from scheduler.model_thread import ModelThread
from scheduler.plan import RestorePlan, StoredLayer, plan_restore
from statekeeper.compression import StoredForm, restore_state
from statekeeper.compression.attention_stats import AttentionStats
from statekeeper.compression.head_budget import live_bias
from statekeeper.kv_cache import KVCache
from statekeeper.profile import HardwareProfile
from statekeeper import device_profile
from statekeeper.device_restore import DeviceRestorer, RingTooSmall
from statekeeper.restore_pipeline import LayerwiseRestore, LoadFailed, layerwise_supported, restore_pipelined
from statekeeper.sessions.exact_copy import CopyCounters, copy_key, delete_stored
from statekeeper.worker import ModelWorker
from storage import serialization
from storage.manager import TierManager

log = logging.getLogger(__name__)


_MAX_GROUP_SIZE = 4096  # the largest quantization group settings admit


def stored_form(header: serialization.BlobHeader) -> StoredForm:
    """The blob's form (compression/form.py); BlobError for meta that describes nothing this service reads."""
    try:
        return StoredForm.from_meta(header.meta)
    except ValueError as exc:
        raise serialization.BlobError(f"blob meta: {exc}") from None


def check_fits_model(header: serialization.BlobHeader, worker: ModelWorker) -> None:
    """Raises BlobError unless every size the header declares fits this model's shape and the blob's token
    count, before anything is allocated from it: the checksums stop accidents, not a crafted header
    (100,000 "heads" in a counts tensor made restore allocate a [100,000, tokens, head_dim] cache per layer,
    a quantized tensor's declared shape is allocated as it stands, its last dimension sizes a rotation
    matrix). One layer's dense K is the most any stored or decoded tensor can hold."""
    num_tokens = header.num_tokens
    dense = worker.num_kv_heads * num_tokens * worker.head_dim
    form = stored_form(header)
    if form.num_tokens not in (None, num_tokens):
        raise serialization.BlobError("blob meta and header disagree on the token count")
    if form.window_starts and (len(form.window_starts) != worker.num_layers or any(
            start > (0 if window is None else max(0, num_tokens - window))
            for start, window in zip(form.window_starts, worker.sliding_windows))):
        raise serialization.BlobError("blob leaves out rows that the model's attention still reads")
    for entry in header.tensors:
        _check_layers(entry.name.split(".")[0].split("+"), worker.num_layers)
        if _elements(entry.shape) > max(dense, worker.num_kv_heads):
            raise serialization.BlobError(f"tensor {entry.name} is larger than the model's KV")
        if entry.name.endswith(".counts") and entry.shape != [worker.num_kv_heads]:
            raise serialization.BlobError(f"tensor {entry.name} does not count the model's KV heads")
        # K and V rows as stored (a codec's are name.codes, checked below): a narrower row would be broadcast
        if entry.name.endswith((".k", ".v")) and (len(entry.shape) < 2 or entry.shape[-1] != worker.head_dim):
            raise serialization.BlobError(f"tensor {entry.name} does not have the model's head dim")
    for pair in form.pairs:
        _check_layers(pair, worker.num_layers)
    quant = form.codec
    if quant is not None:
        for name, info in _items(quant.get("tensors")):
            _check_quantized(name, info, dense, worker)


def _check_quantized(name: str, info, dense: int, worker: ModelWorker) -> None:
    shape, padded = _shape(info.get("shape")), _shape(info.get("padded", info.get("shape")))
    group_size = info.get("group_size")
    if shape is None or padded is None or not shape or shape[-1] != worker.head_dim:
        raise serialization.BlobError(f"quantized tensor {name} does not have the model's head dim")
    if type(group_size) is not int or not 0 < group_size <= _MAX_GROUP_SIZE:
        raise serialization.BlobError(f"quantized tensor {name} has an impossible group size")
    padding = worker.num_kv_heads * group_size * worker.head_dim  # tokens padded up to whole groups
    if _elements(shape) > dense or _elements(padded) > dense + padding:
        raise serialization.BlobError(f"quantized tensor {name} is larger than the model's KV")


def _check_layers(indices, num_layers: int) -> None:
    if not all(str(i).isdigit() and int(i) < num_layers for i in indices):
        raise serialization.BlobError("blob names a layer the model does not have")


def _shape(value) -> list[int] | None:
    is_shape = isinstance(value, list) and all(type(size) is int and size >= 0 for size in value)
    return value if is_shape else None


def _elements(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _items(described):
    if not isinstance(described, dict) or not all(isinstance(info, dict) for info in described.values()):
        raise serialization.BlobError("blob quantization table is malformed")
    return described.items()


@dataclass(slots=True)
class LoadedKV:
    cache: KVCache
    tier: str
    num_tokens: int  # tokens the blob covered (a prefix of the history, or all of it)
    form: StoredForm  # what the blob held (compression method, codec), from its header
    pipeline: dict | None = None  # the pipeline's report when part was recomputed
    logits: torch.Tensor | None = None  # the prompt's prefill ran with the restore (layer by layer)
    layerwise: dict | None = None  # that layer-by-layer restore's timeline (LayerwiseReport.summary)
    device: dict | None = None  # a GPU worker's restore (DeviceRestoreReport.summary)
    exact_copy: str | None = None  # the tier of the exact copy it took (exact_copy.py)


class BlobLoader:
    """Runs on an I/O thread; model work (a pipelined restore's recompute) goes to the model thread."""

    def __init__(self, worker: ModelWorker, tiers: TierManager, model_thread: ModelThread,
                 hardware: HardwareProfile | None, exact_copy_tier: str | None = None,
                 device_restorer: DeviceRestorer | None = None):
        """`device_restorer`: a GPU worker's (statekeeper/device_restore.py): blobs go to the device as stored,
        on its copy stream, and the turn's prompt is queued behind them."""
        self.worker = worker
        self.device_restorer = device_restorer
        self.tiers = tiers
        self.model_thread = model_thread
        self.hardware = hardware  # restore planning; None loads every stored token
        self.exact_copy_tier = exact_copy_tier  # EXACT_COPY_TIER: compressed restores take the exact copy there
        self.copies = CopyCounters()

    def load(self, session_id: str, tokens: list[int], plan: bool = True, prompt: list[int] | None = None,
             stats: AttentionStats | None = None) -> LoadedKV | None:
        """The stored KV of `tokens` if a valid blob exists; a bad blob is counted, discarded and never
        used. `plan=False` loads every stored token (no recompute on the model thread). With `prompt` (the
        tokens the turn feeds: `tokens` and the new message), a compressed per-head blob is decoded layer
        by layer behind the prompt's prefill (with `stats`), and the result carries the logits."""
        # Keys found bad while the blob is read are deleted once that read is closed: a delete waits for the
        # writers' lock, whose holder may be waiting for every read to end (LMDB's map growth): a deadlock
        stale: list[str] = []
        try:
            return self._load(session_id, tokens, plan, prompt, stats, stale)
        finally:
            for key in stale:
                self.tiers.delete(key)

    def _load(self, session_id: str, tokens: list[int], plan: bool, prompt: list[int] | None,
              stats: AttentionStats | None, stale: list[str]) -> LoadedKV | None:
        recomputed = None
        with self.tiers.read(session_id) as (tier, blob):
            if blob is None:
                return None
            try:
                loaded = self._import(session_id, blob, tokens, tier, plan, prompt, stats, stale)
                if loaded is None or loaded.tier != "recompute":
                    return self._with_min_cut(loaded)
                log.warning("discarding KV blob of %s from %s: its layers did not load", session_id, tier)
                self.tiers.record_error(tier)
                recomputed = loaded
            except serialization.BlobMismatch as exc:
                if self.tiers.tier(tier).is_shared:  # another replica's newer state, maybe: not this one's to drop
                    log.info("not using the KV blob of %s in %s: %s", session_id, tier, exc)
                    return None
                log.warning("discarding KV blob of %s from %s: %s", session_id, tier, exc)
                self.tiers.record_error(tier)
            except serialization.BlobError as exc:
                log.warning("discarding KV blob of %s from %s: %s", session_id, tier, exc)
                self.tiers.record_error(tier)
            except Exception:  # a blob that passed its checks but still cannot be used: recompute, never fail
                log.exception("discarding unusable KV blob of %s from %s", session_id, tier)
                self.tiers.record_error(tier)
        delete_stored(self.tiers, session_id)
        return recomputed

    def _with_min_cut(self, loaded: LoadedKV | None) -> LoadedKV | None:
        """Marks how short a state loaded on a model with sliding-window layers may be cut (KVCache.min_cut):
        an exact one down to where each trimmed layer's window still covers the last token; any other form
        (its source may have been trimmed) only to its last token, which a scoring request refeeds. So is an
        exact one with a bias: a state restored from a compressed blob (zeros before its sliding layers'
        windows) and stored again, which records no window starts."""
        if loaded is None or not self.worker.has_sliding_layers or loaded.num_tokens == 0:
            return loaded
        form = loaded.form
        if form.kind == "exact" and not form.bias:
            loaded.cache.min_cut = max((start + window - 1 for start, window in
                                        zip(form.window_starts, self.worker.sliding_windows) if start and window),
                                       default=0)
        else:
            loaded.cache.min_cut = loaded.num_tokens - 1
        return loaded

    def _import(self, session_id: str, blob, tokens: list[int], tier: str, plan: bool, prompt: list[int] | None,
                stats: AttentionStats | None, stale: list[str]) -> LoadedKV | None:
        # Its own frame, so no view into the tier's buffer outlives the read (an mmap cannot close
        # while views into it exist).
        header, tensors = serialization.decode_tensors(blob, self.worker.fingerprint, tokens)
        check_fits_model(header, self.worker)
        form = stored_form(header)
        if form.is_compressed and self.exact_copy_tier is not None:
            loaded = self._from_exact_copy(session_id, header, tensors, form, tier, tokens, stale)
            if loaded is not None:
                return loaded
        if self.device_restorer is not None and header.num_tokens > 0:
            loaded = self._restored_on_device(header, tensors, form, tier, tokens, prompt, stats, plan)
            if loaded is not None:
                return loaded
        if prompt is not None and len(prompt) > header.num_tokens > 0 and layerwise_supported(form):
            # Decoding a compressed blob costs more than moving it: hide it behind the turn's wait for the
            # model thread and the prompt's prefill (statekeeper/restore_pipeline.py); this I/O thread holds the read
            # open until the job is done.
            restore = LayerwiseRestore(self.worker, tensors, form, prompt)
            if not self.model_thread.is_idle():
                return self._loaded_apart(restore, tier, header.num_tokens, form)
            try:
                cache, logits, report = self.model_thread.submit(restore.finish, stats).result()
            finally:
                restore.abandon()
            if report.fallback is not None:  # recomputed from the tokens: the cache is good, the blob is not
                return LoadedKV(cache, "recompute", 0, StoredForm(), logits=logits)
            return LoadedKV(cache, tier, header.num_tokens, form, logits=logits, layerwise=report.summary())
        # Under load the plan's recompute would hold every other user's step: read the blob whole.
        restore_plan = self._plan(header.num_tokens, form, tier) if plan and self.model_thread.is_idle() else None
        if restore_plan is not None and restore_plan.recompute_tokens == restore_plan.num_tokens:
            return None  # recomputing everything is faster than reading this tier
        if restore_plan is not None and restore_plan.recompute_tokens > 0:
            # Recompute a prefix on the model thread while a loader copies the rest out of the blob;
            # this I/O thread holds the read (and so the blob's views) open until it is done.
            layers = serialization.plain_layers(header, tensors)
            cache, report = self.model_thread.submit(restore_pipelined, self.worker, layers, tokens,
                                                     restore_plan).result()
            return LoadedKV(cache, tier, header.num_tokens, form, report.summary())
        layers, bias = restore_state(tensors, form, self.worker.num_layers)
        self._check_shapes(layers, bias, header.num_tokens)
        return LoadedKV(KVCache.from_layers(layers, self.worker.device, bias), tier, header.num_tokens, form)

    def _restored_on_device(self, header: serialization.BlobHeader, tensors: dict, form: StoredForm, tier: str,
                            tokens: list[int], prompt: list[int] | None, stats: AttentionStats | None,
                            plan: bool) -> LoadedKV | None:
        """A plain or per-head compressed blob restored by the device restorer on the model thread, with the
        turn's prompt after it where there is one and the model thread is idle (the logits come back; under
        load the prompt rides the batch a chunk at a time, as `_loaded_apart`'s does); None for other forms
        (the generic path restores them). A prefix is recomputed only where `plan` allows it and the model
        thread is idle. A blob whose layers do not fit is recomputed (fallback: "recompute")."""
        restorer, num_tokens, idle = self.device_restorer, header.num_tokens, self.model_thread.is_idle()
        history = (prompt if prompt is not None else tokens)[:num_tokens]
        message = prompt[num_tokens:] if prompt is not None and idle else []
        if layerwise_supported(form):
            job = partial(restorer.restore_compressed, tensors, form, history, message, stats)
        elif form.is_plain and not form.window_starts:
            recompute = 0  # Krul's split from the device's profile; under load a recompute would hold others
            if restorer.profile is not None and plan and idle:
                recompute = device_profile.plan(restorer.profile, num_tokens, len(message),
                                                self.worker.kv_bytes_per_token).recompute_tokens
            job = partial(restorer.restore_exact, serialization.plain_layers(header, tensors), history, message,
                          recompute, stats)
        else:
            return None
        try:
            cache, logits, report = self.model_thread.submit(job).result()
        except RingTooSmall as exc:  # a restore longer than the pinned ring stages: the generic path loads it
            log.info("restoring %s tokens without the device restorer: %s", num_tokens, exc)
            return None
        logits = logits if message else None  # only the prompt's: without it a turn takes them for its prefill
        if report.fallback is not None:  # recomputed from the tokens: the cache is good, the blob is not
            return LoadedKV(cache, "recompute", 0, StoredForm(), logits=logits)
        return LoadedKV(cache, tier, num_tokens, form, logits=logits, device=report.summary())

    def _check_shapes(self, layers, bias: list | None, num_tokens: int) -> None:
        """BlobError unless the restored layers (and bias) have the model's shape at `num_tokens`."""
        shape = (self.worker.num_kv_heads, num_tokens, self.worker.head_dim)
        if any(tuple(k.shape) != shape or tuple(v.shape) != shape for k, v in layers):
            raise serialization.BlobError("blob layers do not have the model's shape and the blob's token count")
        if bias is not None and any(tuple(b.shape) != shape[:2] for b in bias):
            raise serialization.BlobError("blob attention bias does not fit its layers")

    def _from_exact_copy(self, session_id: str, header: serialization.BlobHeader, tensors: dict, form: StoredForm,
                         tier: str, tokens: list[int], stale: list[str]) -> LoadedKV | None:
        """The conversation's exact copy in place of its compressed blob: None where there is no copy, or it is
        not this state's (named in `stale` then, to be deleted). Never fails the compressed blob."""
        key, num_layers = copy_key(session_id), self.worker.num_layers
        try:
            with self.tiers.read(key) as (copy_tier, copy):
                if copy is None:
                    self.copies.missing += 1
                    return None
                copy_header, copy_tensors = serialization.decode_tensors(copy, self.worker.fingerprint, tokens)
                check_fits_model(copy_header, self.worker)
                copy_form = stored_form(copy_header)
                # A sliding-window layer's rows before its window come back as zeros that no later token reads
                # (check_fits_model checked the starts); the loader cuts a compressed restore no shorter than
                # its last token (min_cut), so none is read
                if copy_form.kind != "exact" or copy_header.num_tokens != header.num_tokens:
                    raise serialization.BlobError("the exact copy is of another state")
                if copy_form.codec is not None:  # a tier with a codec re-encoded it (moved or put below its own)
                    raise serialization.BlobError(f"the exact copy was re-encoded ({copy_form.codec_name})")
                layers, bias = restore_state(copy_tensors, copy_form, num_layers)  # bias: a state evicted before
                # The copy is read whole before the prompt's prefill begins, so it is taken whole (issue 33: "where
                # the exact copy can be read in full before the prefill ends, the planner may simply take it"):
                # the replies of a state never compressed. A blob that names a live selection
                # (COMPRESSION_LIVE_KEEP) asks for that working set of it from the reply on.
                live = live_bias(tensors, header.num_tokens, num_layers)
                self._check_shapes(layers, bias, header.num_tokens)
                self._check_shapes(layers, live, header.num_tokens)
                if live is not None and bias is not None:
                    live = [a + b for a, b in zip(live, bias)]
                cache = KVCache.from_layers(layers, self.worker.device, bias)  # copies out of the tier's buffer
                cache.reply_bias = None if live is None else [b.to(self.worker.device, copy=True) for b in live]
        except Exception as exc:  # a bad copy costs only itself: the compressed blob restores as without one
            log.warning("discarding the exact copy of %s: %s", session_id, exc)
            self.copies.rejected += 1
            stale.append(key)
            return None
        self.copies.restores += 1
        return LoadedKV(cache, tier, header.num_tokens, form, exact_copy=copy_tier)

    def _loaded_apart(self, restore: LayerwiseRestore, tier: str, num_tokens: int, form: StoredForm) -> LoadedKV:
        """The model thread has other users' work: the prompt's prefill as one job with the restore would
        hold all of them for its whole length, so the layers decode here and the turn's prompt then rides
        the batch a chunk at a time like any other (the same KV and logits: tests/statekeeper/sessions)."""
        try:
            cache, report = restore.loaded()
        except LoadFailed as exc:
            restore.report.fallback = f"{type(exc).__name__}: {exc}"
            return LoadedKV(self.worker.new_cache(), "recompute", 0, StoredForm())
        return LoadedKV(cache, tier, num_tokens, form, layerwise=report.summary())

    def _plan(self, num_tokens: int, form: StoredForm, tier: str) -> RestorePlan | None:
        """Krul §6's split for a plain (uncompressed) blob on this tier, from the hardware profile."""
        if self.hardware is None or not form.is_plain or tier not in self.hardware.tiers or num_tokens == 0:
            return None
        if not self.tiers.tier(tier).streams_reads:
            return None  # the blob is already fetched whole: loading the rest is a memory copy
        worker = self.worker
        per_layer = StoredLayer(2 * worker.num_kv_heads * worker.head_dim * worker.kv_dtype.itemsize)
        return plan_restore(num_tokens, [per_layer] * worker.num_layers, self.hardware.compute,
                            self.hardware.tiers[tier])
