"""The GPU suite (`make test-gpu`): the restore on CUDA streams against the state that never left the
device and against the CPU reference. Every test here is marked `cuda` and skipped without a GPU."""

import pytest
import torch

from kernels.device_copy import copy_rows, copy_rows_reference
from statekeeper.batch_forward import Segment
from statekeeper.compression.form import StoredForm
from statekeeper.config import WorkerConfig
from statekeeper.device_restore import DeviceRestorer, PinnedRing
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE
from tests.statekeeper.restore_cases import MESSAGE, TOKENS, compressed, sequential

pytestmark = pytest.mark.cuda


def _worker(model_dir, device: str, dtype: str = "float32") -> ModelWorker:
    config = WorkerConfig(model=str(model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64, device=device,
                          dtype=dtype)
    return ModelWorker(load_model(config.model, config.model_cache_dir, config.device, config.dtype), config)


@pytest.fixture(scope="module")
def gpu_worker(tiny_model_dir):
    return _worker(tiny_model_dir, "cuda")


@pytest.fixture(scope="module")
def cpu_worker(tiny_model_dir):
    return _worker(tiny_model_dir, "cpu")


def _hot(worker, tokens=TOKENS, message=MESSAGE):
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    return cache, worker.prefill(cache, message)


def _stored(worker, pinned=True, tokens=TOKENS):
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    layers = [(k.cpu(), v.cpu()) for k, v in cache.export_layers()]
    return [(k.pin_memory(), v.pin_memory()) for k, v in layers] if pinned else layers


def _ring(worker, stored, slots=4):
    return PinnedRing.for_copies([t.nbytes for k, v in stored for t in (k, v)], pinned=True, num_slots=slots)


def _greedy(worker, cache, logits, steps=6):
    out = []
    for _ in range(steps):
        out.append(int(logits.argmax()))
        logits = worker.decode(cache, out[-1])
    return out


@pytest.mark.parametrize("per_head", [False, True])
def test_a_2d_copy_from_pinned_memory_equals_a_plain_copy(per_head):
    source = torch.randn(3, 700, 64, dtype=torch.bfloat16).pin_memory()
    buffer = torch.zeros(1, 3, 1024, 64, dtype=torch.bfloat16, device="cuda")
    expected = buffer.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    copy_rows(buffer[0, :, 100:690], source[:, 100:690], stream, per_head=per_head)
    copy_rows_reference(expected[0, :, 100:690], source[:, 100:690])
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(buffer, expected)
    with pytest.raises(ValueError, match="pinned"):
        copy_rows(buffer[0, :, :10], source[:, :10].clone(), stream)


@pytest.mark.parametrize("copier", ["thread", "inline"])
def test_an_exact_restore_equals_the_state_that_never_left_the_device(gpu_worker, copier):
    hot, hot_logits = _hot(gpu_worker)
    stored = _stored(gpu_worker)
    cache, logits, report = DeviceRestorer(gpu_worker, copier=copier).restore_exact(stored, TOKENS, MESSAGE)
    assert torch.equal(logits, hot_logits)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(hot.export_layers(), cache.export_layers()))
    assert report.host_waits == 0 and report.staged_bytes == 0
    assert report.timeline()["copy_ms"] > 0


@pytest.mark.parametrize("recompute", [1, 63, 64, 100, 199, 200])
def test_a_pipelined_restore_equals_the_hot_state_at_every_split(gpu_worker, recompute):
    hot, hot_logits = _hot(gpu_worker)
    stored = _stored(gpu_worker)
    cache, logits, _ = DeviceRestorer(gpu_worker).restore_exact(stored, TOKENS, MESSAGE, recompute)
    for (k, v), (k2, v2) in zip(hot.export_layers(), cache.export_layers()):
        assert torch.equal(k[:, recompute: len(TOKENS)], k2[:, recompute: len(TOKENS)])
        # float32 (no TF32): another chunking changes the reduction order, ~1e-6 relative over 4 layers
        assert torch.allclose(k, k2, atol=1e-4, rtol=1e-4) and torch.allclose(v, v2, atol=1e-4, rtol=1e-4)
    assert torch.allclose(logits, hot_logits, atol=1e-4, rtol=1e-4)
    assert _greedy(gpu_worker, cache, logits) == _greedy(gpu_worker, hot, hot_logits)


@pytest.mark.parametrize("slots", [4, 2])
def test_a_state_outside_pinned_memory_is_staged_through_the_ring(gpu_worker, slots):
    hot, hot_logits = _hot(gpu_worker)
    stored = _stored(gpu_worker, pinned=False)
    ring = _ring(gpu_worker, stored) if slots == 4 else PinnedRing(stored[0][0].nbytes, 2, pinned=True)
    restorer = DeviceRestorer(gpu_worker, ring)
    cache, logits, report = restorer.restore_exact(stored, TOKENS, MESSAGE)
    assert torch.equal(logits, hot_logits) and report.staged_bytes == report.copied_bytes
    # a ring sized for the restore holds it; one too small goes round (waiting where a copy has not left)
    assert (report.reused_slots == 0) == (slots == 4) and report.host_waits <= report.reused_slots
    cache, logits, _ = restorer.restore_exact(stored, TOKENS, MESSAGE)  # the ring reused
    assert torch.equal(logits, hot_logits)


@pytest.mark.parametrize("method", ["expected@0.5+int4", "expected@0.5+int4-rot-g32-s1", "expected-merge@0.5",
                                    "expected@0.3+int8", "expected@0.5+int4-pk10", "expected@0.5+int4-kc",
                                    "expected@0.5+int4-v2", "expected@0.5+int4-v3-rot-vsym", "expected@0.2+int4",
                                    "expected-global@0.5+int4-v3-rot-sym-pk8-s1"])
@pytest.mark.parametrize("groups", [1, 4])  # the tiny model's four layers decoded together, or one by one
def test_a_blob_decoded_on_the_device_equals_the_cpu_decode(gpu_worker, cpu_worker, method, groups):
    tensors, form = compressed(cpu_worker, method)
    reference, _ = sequential(cpu_worker, tensors, form)  # the CPU restore: the torch reference
    ring = PinnedRing(1 << 22, 4, pinned=True)
    restorer = DeviceRestorer(gpu_worker, ring, compressed_groups=groups)
    cache, logits, report = restorer.restore_compressed(tensors, form, TOKENS, MESSAGE)
    # as stored, each tensor padded to 64 bytes in its layer's one copy
    assert report.fallback is None and report.copied_bytes <= sum(t.nbytes + 64 for t in tensors.values())
    exact = "-rot" not in method  # a rotation is a float32 product: another summation order on the GPU
    for (k, v), (k2, v2) in zip(reference.export_layers(), cache.export_layers()):
        k2, v2 = k2[:, : len(TOKENS)].cpu(), v2[:, : len(TOKENS)].cpu()
        if exact:
            assert torch.equal(k[:, : len(TOKENS)], k2) and torch.equal(v[:, : len(TOKENS)], v2)
        else:  # 64 products summed: a few float32 roundings of the row's size
            assert torch.allclose(k[:, : len(TOKENS)], k2, atol=1e-5, rtol=1e-5)
    for a, b in zip(reference.head_bias, cache.head_bias):  # log(votes): CUDA's and the CPU's log differ by <= 1 ulp each
        assert torch.equal(a.isinf(), b.cpu().isinf()) and torch.allclose(a, b.cpu(), rtol=2 ** -22, atol=0)
    on_gpu, gpu_logits = sequential(gpu_worker, tensors, form)  # the same restore done first, then the message
    assert torch.allclose(logits, gpu_logits, atol=1e-4, rtol=1e-4)
    assert _greedy(gpu_worker, cache, logits, 4) == _greedy(gpu_worker, on_gpu, gpu_logits, 4)


@pytest.mark.parametrize("copier", ["thread", "inline"])
def test_a_restore_queues_everything_without_waiting_for_the_device(gpu_worker, cpu_worker, copier):
    """A spin on the compute stream holds the device busy: a restore that waited for the device anywhere
    (a synchronize, a read-back, a copy from pageable memory) would take the spin's time to return."""
    stored = _stored(gpu_worker)
    tensors, form = compressed(cpu_worker, "expected-global@0.5+int4-v3-rot-sym-pk8-s1")
    restorer = DeviceRestorer(gpu_worker, PinnedRing(1 << 22, 4, pinned=True), compressed_groups=2, copier=copier)
    for _ in range(2):  # warm: kernels loaded, allocator and pinned pools filled
        restorer.restore_exact(stored, TOKENS, MESSAGE, 64)
        restorer.restore_compressed(tensors, form, TOKENS, MESSAGE)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1 << 30)
    end.record()
    end.synchronize()
    spin_ms = start.elapsed_time(end)
    for restore in (lambda: restorer.restore_exact(stored, TOKENS, MESSAGE, 64),
                    lambda: restorer.restore_compressed(tensors, form, TOKENS, MESSAGE)):
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)
        torch.cuda.set_sync_debug_mode("error")
        try:
            _, _, report = restore()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert report.enqueue_ms < spin_ms / 2, (report.enqueue_ms, spin_ms)
        assert not report.events["end"].query()  # the device is still busy with the spin
        report.timeline()


def test_a_bfloat16_restore_equals_the_hot_state_bit_for_bit(tiny_model_dir):
    worker = _worker(tiny_model_dir, "cuda", "bfloat16")
    hot, hot_logits = _hot(worker)
    cache, logits, _ = DeviceRestorer(worker).restore_exact(_stored(worker), TOKENS, MESSAGE)
    assert torch.equal(logits, hot_logits)
    assert _greedy(worker, cache, logits) == _greedy(worker, hot, hot_logits)


def test_a_batched_step_on_the_device_gives_what_each_conversation_gives_alone(gpu_worker):
    conversations = [TOKENS, TOKENS[:77], list(range(40, 150))]
    alone, caches = [], []
    for tokens in conversations:
        cache = gpu_worker.new_cache()
        gpu_worker.prefill(cache, tokens[:-1])
        caches.append(cache)
        separate = gpu_worker.new_cache()
        gpu_worker.prefill(separate, tokens[:-1])
        alone.append(gpu_worker.decode(separate, tokens[-1]))
    batched = gpu_worker.step([Segment(cache, [tokens[-1]]) for cache, tokens in zip(caches, conversations)])
    for one, many in zip(alone, batched):
        assert torch.allclose(one, many, atol=1e-4, rtol=1e-4) and int(one.argmax()) == int(many.argmax())


def test_sparse_bookkeeping_decodes_on_the_device_as_on_the_cpu(gpu_worker, cpu_worker):
    tokens = [5 + i % 290 for i in range(800)]
    tensors, form = compressed(cpu_worker, "expected@0.01+int4-pk5", tokens)
    reference, _ = sequential(cpu_worker, tensors, form)
    restorer = DeviceRestorer(gpu_worker, PinnedRing(1 << 22, 4, pinned=True), compressed_groups=1)
    cache, _, report = restorer.restore_compressed(tensors, form, tokens, MESSAGE)
    assert report.fallback is None
    for (k, v), (k2, v2) in zip(reference.export_layers(), cache.export_layers()):
        assert torch.equal(k[:, : len(tokens)], k2[:, : len(tokens)].cpu())
        assert torch.equal(v[:, : len(tokens)], v2[:, : len(tokens)].cpu())


def test_a_copier_failure_recomputes_from_the_history(gpu_worker, monkeypatch):
    import statekeeper.device_restore as device_restore

    hot, hot_logits = _hot(gpu_worker)
    calls = []

    def failing(target, source, stream, per_head=False):
        calls.append(1)
        if len(calls) > 3:
            raise RuntimeError("copy engine fault")
        return copy_rows(target, source, stream, per_head)

    monkeypatch.setattr(device_restore, "copy_rows", failing)
    cache, logits, report = DeviceRestorer(gpu_worker).restore_exact(_stored(gpu_worker), TOKENS, MESSAGE)
    assert report.fallback is not None and "copy engine fault" in report.fallback
    assert torch.allclose(logits, hot_logits, atol=1e-4, rtol=1e-4)
    assert _greedy(gpu_worker, cache, logits) == _greedy(gpu_worker, hot, hot_logits)


@pytest.mark.parametrize("form", ["exact", "expected@0.5+int4", "expected-global@0.5+int4-v3-rot-sym-pk8-s1"])
def test_a_blob_in_a_pinned_dram_tier_is_copied_in_place(gpu_worker, cpu_worker, form):
    """The service's DRAM tier on a GPU worker holds blobs in page-locked memory (kernels/device_copy.py
    pinned_host_buffer): a restore reads them where they are, staging nothing, with the state a restore of
    the same blob from pageable memory gives; the blob may leave the tier before the copies have run."""
    from kernels.device_copy import pinned_host_buffer
    from statekeeper.compression import by_name
    from storage import serialization
    from storage.dram import DramTier

    cache, stats = cpu_worker.new_cache(), cpu_worker.new_stats()
    cpu_worker.prefill(cache, TOKENS, stats)
    state = (by_name(form).compress(cache.export_layers(), stats) if form != "exact" else None)
    named = state.tensors if state else [(f"{i}.{r}", t) for i, (k, v) in enumerate(cache.export_layers())
                                          for r, t in (("k", k), ("v", v))]
    blob = serialization.encode_tensors(named, gpu_worker.fingerprint, TOKENS, len(TOKENS), state.meta if state else None)
    tier = DramTier(1 << 30, pinned_host_buffer)
    tier.put("conversation", blob)
    restorer = DeviceRestorer(gpu_worker, PinnedRing(1 << 22, 4, pinned=True), compressed_groups=2)

    def restore(buffer):
        header, tensors = serialization.decode_tensors(buffer, gpu_worker.fingerprint, TOKENS + MESSAGE)
        if state is None:
            return restorer.restore_exact(serialization.plain_layers(header, tensors), TOKENS, MESSAGE)
        return restorer.restore_compressed(tensors, StoredForm.from_meta(header.meta), TOKENS, MESSAGE)

    pageable_cache, pageable_logits, pageable = restore(bytes(blob))
    restore(tier.get("conversation"))  # warm: pinned pools, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # in place, too, the host never waits for the device
    try:
        in_place_cache, in_place_logits, report = restore(tier.get("conversation"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tier.delete("conversation")  # the tier lets go at once: the restorer holds the memory until the copies ran
    assert pageable.staged_bytes > 0 and report.staged_bytes == 0 and report.fallback is None
    assert torch.equal(in_place_logits, pageable_logits)
    for (k, v), (k2, v2) in zip(pageable_cache.export_layers(), in_place_cache.export_layers()):
        assert torch.equal(k, k2) and torch.equal(v, v2)
