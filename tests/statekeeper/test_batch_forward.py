"""The packed forward (statekeeper/batch_forward.py) through the worker's public `step`: several
conversations in one forward get what each gets alone, within float rounding of matrix products over more
rows (the attention of each is computed exactly as alone)."""

import math

import pytest
import torch

from statekeeper.batch_forward import Segment, supports_packing

from statekeeper.config import WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE

TOLERANCE = 1e-4  # the tiny model's logits differ by ~1e-5 between a batch and alone (GEMMs over more rows)


def same_kv(a, b) -> bool:
    """Equal within the GEMMs' rounding. In a bfloat16 cache that rounding flips the last bit kept of some
    entries (1/128 relative), and the attention of later steps and layers reads them: entries near zero then
    differ by up to a few thousandths, so the bound is a few last bits at this model's magnitudes (~4)."""
    if a.dtype == torch.float32:
        return torch.allclose(a, b, atol=TOLERANCE)
    return torch.allclose(a.float(), b.float(), atol=0.05, rtol=2 * torch.finfo(a.dtype).eps)


@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def worker(request, tiny_model_dir):
    """The model's own dtype for the KV cache, and a bfloat16 KV cache (WorkerConfig.kv_dtype)."""
    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64,
                          kv_dtype=request.param)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


def histories(worker, count, base=90):
    generator = torch.Generator().manual_seed(count)
    vocab = worker.model.config.vocab_size
    return [torch.randint(3, vocab, (base + 23 * i,), generator=generator).tolist() for i in range(count)]


def prefilled(worker, tokens):
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    return cache


def greedy_alone(worker, cache, token, steps):
    out = []
    for _ in range(steps):
        token = int(worker.step([Segment(cache, [token])])[0].argmax())
        out.append(token)
    return out


def test_one_segment_is_exactly_a_decode(worker):
    history = histories(worker, 1)[0]
    a, b = prefilled(worker, history), prefilled(worker, history)
    assert torch.equal(worker.step([Segment(a, [7])])[0], worker.decode(b, 7))


def test_sessions_decoding_together_get_the_tokens_and_kv_each_gets_alone(worker):
    stories = histories(worker, 4)
    alone = [prefilled(worker, h) for h in stories]
    together = [prefilled(worker, h) for h in stories]
    expected = [greedy_alone(worker, cache, 5, 20) for cache in alone]
    tokens, produced = [5] * 4, [[] for _ in stories]
    for _ in range(20):
        logits = worker.step([Segment(cache, [t]) for cache, t in zip(together, tokens)])
        tokens = [int(row.argmax()) for row in logits]
        for out, token in zip(produced, tokens):
            out.append(token)
    assert produced == expected
    for a, b in zip(alone, together):
        assert a.num_tokens == b.num_tokens
        for (ka, va), (kb, vb) in zip(a.export_layers(), b.export_layers()):
            assert same_kv(ka, kb) and same_kv(va, vb)


def test_a_prefill_chunk_riding_with_decodes_equals_the_same_chunk_alone(worker):
    stories = histories(worker, 3)
    prompt = list(range(10, 74))
    alone = [prefilled(worker, h) for h in stories]
    together = [prefilled(worker, h) for h in stories]
    expected = [worker.step([Segment(alone[0], prompt)])[0]] + [
        worker.step([Segment(cache, [9])])[0] for cache in alone[1:]]
    got = worker.step([Segment(together[0], prompt)] + [Segment(cache, [9]) for cache in together[1:]])
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, atol=TOLERANCE) and int(e.argmax()) == int(g.argmax())
    assert [c.num_tokens for c in together] == [c.num_tokens for c in alone]


def test_a_compressed_session_with_a_head_bias_rides_with_plain_ones(worker):
    stories = histories(worker, 3)
    caches = {name: [prefilled(worker, h) for h in stories] for name in ("alone", "together")}
    generator = torch.Generator().manual_seed(1)
    bias = []
    for keys, _ in caches["alone"][0].export_layers():
        layer_bias = torch.zeros(keys.shape[0], keys.shape[1])
        layer_bias[torch.rand(layer_bias.shape, generator=generator) < 0.3] = -math.inf  # evicted entries
        layer_bias[:, :4] = 0.0
        bias.append(layer_bias)
    for group in caches.values():
        group[0].head_bias = [b.clone() for b in bias]
    expected = [worker.step([Segment(cache, [11, 12, 13])])[0] for cache in caches["alone"][:1]] + [
        worker.step([Segment(cache, [11])])[0] for cache in caches["alone"][1:]]
    got = worker.step([Segment(caches["together"][0], [11, 12, 13])] +
                           [Segment(cache, [11]) for cache in caches["together"][1:]])
    for e, g in zip(expected, got):
        assert torch.allclose(e, g, atol=TOLERANCE)
    unbiased = prefilled(worker, stories[0])
    assert not torch.allclose(worker.step([Segment(unbiased, [11, 12, 13])])[0], got[0], atol=TOLERANCE)


def test_statistics_of_a_session_in_a_batch_are_those_it_gathers_alone(worker):
    stories = histories(worker, 2)
    runs = {}
    for name in ("alone", "together"):
        caches = [worker.new_cache() for _ in stories]
        stats = [worker.new_stats() for _ in stories]
        if name == "alone":
            for cache, history, s in zip(caches, stories, stats):
                worker.step([Segment(cache, history, s)])
                for _ in range(8):
                    worker.step([Segment(cache, [5], s)])
        else:
            worker.step([Segment(c, h, s) for c, h, s in zip(caches, stories, stats)])
            for _ in range(8):
                worker.step([Segment(c, [5], s) for c, s in zip(caches, stats)])
        runs[name] = stats
    for alone, together in zip(runs["alone"], runs["together"]):
        assert alone.distance_rows == together.distance_rows > 0
        assert torch.allclose(alone.ir_scores(), together.ir_scores(), atol=1e-4)
        assert torch.allclose(alone.key_scores, together.key_scores, atol=1e-4)


def test_models_with_sliding_windows_are_not_packed(worker):
    assert supports_packing(worker.model)
    config = worker.model.config
    config.sliding_window, previous = 32, getattr(config, "sliding_window", None)
    try:
        assert not supports_packing(worker.model)
    finally:
        config.sliding_window = previous


def test_a_prefill_chunked_across_batched_steps_equals_one_unchunked_forward(worker):
    from scheduler.batch import BatchLimits
    from scheduler.model_thread import ModelThread

    def run_step(entries):
        return worker.step([Segment(cache, tokens) for cache, tokens in entries])

    thread = ModelThread(run_step, BatchLimits(chunk_tokens=32, prefill_tokens=32, gather_seconds=0))
    prompt = histories(worker, 1, base=150)[0]
    decoders = [prefilled(worker, h) for h in histories(worker, 2)]
    cache = worker.new_cache()
    try:
        prefill = thread.submit_step("p", cache, prompt)  # 5 chunks, each riding with the two decoders
        decodes = [thread.submit_step(f"d{i}", decoder, [5]) for i, decoder in enumerate(decoders)]
        logits = prefill.future.result(timeout=30)
        for job in decodes:
            job.future.result(timeout=30)
    finally:
        thread.shutdown()
    assert thread.batching()["steps"] == 5 and thread.batching()["sessions"] == 7
    with torch.inference_mode():
        one_shot = worker.model(input_ids=torch.tensor([prompt]), past_key_values=worker.new_cache(),
                                     use_cache=True).logits[0, -1]
    assert torch.allclose(logits, one_shot, atol=TOLERANCE) and int(logits.argmax()) == int(one_shot.argmax())
    assert cache.num_tokens == len(prompt)
