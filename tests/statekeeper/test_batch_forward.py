"""The packed forward (statekeeper/batch_forward.py) through the worker's public `step`.

What the README promises, asserted the same way on every CPU whatever kernels torch picks there:
- a conversation's attention is computed exactly as alone, so its logits, KV and statistics do not depend
  on who rides with it: in two batches of the same row counts (the same matrix-product shapes) with other
  neighbours, its results are bit for bit the same;
- only the matrix products see more rows than alone, so against alone its results differ by their
  rounding: within float32's rounding for a float32 cache; in a bfloat16 cache that rounding can move a
  stored key or value to the neighbouring bfloat16 number, so by at most about one bfloat16 step at the
  magnitude of the values compared (`bound`), and the greedy token is the same wherever the top two
  logits are further apart than that.
The last tests run deliberately wrong batched attentions and check that these assertions catch them."""

import math

import pytest
import torch

from statekeeper import batch_forward
from statekeeper.batch_forward import Segment, supports_packing
from statekeeper.compression import attention_stats
from statekeeper.config import WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE

# float32 matrix products over more rows reorder sums of ~100-1,000 terms of magnitude ~1: a few float32
# epsilons (1.2e-7) per term, ~1e-5 on the tiny model's logits (magnitude ~5); ten times that.
FLOAT32_TOLERANCE = 1e-4


def step(value: float, dtype: torch.dtype) -> float:
    """The distance between neighbouring numbers of `dtype` at magnitude `value`."""
    value = max(abs(value), torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(value))


def bound(worker, reference: torch.Tensor, steps: float) -> float:
    """How far a result computed with a batch's matrix products may be from `reference`, computed alone.
    A float32 cache: float32 rounding. A cache of a narrower dtype also rounds every key, value, query and
    attention output to that dtype, and a batch can move any of them to the neighbouring number: `steps`
    steps of the cache's dtype at the result's magnitude."""
    if worker.kv_dtype == torch.float32:
        return FLOAT32_TOLERANCE
    return FLOAT32_TOLERANCE + steps * step(float(reference.abs().max()), worker.kv_dtype)


def assert_logits_close(worker, alone: torch.Tensor, batched: torch.Tensor) -> None:
    """Each decoder layer's rounded values may move a step; the logits carry at most one step (at their own
    magnitude) per layer. Observed on the tiny model: under 0.7 of one step."""
    limit = bound(worker, alone, steps=worker.num_layers)
    assert float((alone - batched).abs().max()) <= limit
    top = alone.topk(2).values
    if float(top[0] - top[1]) > 2 * limit:  # the margin allows no other greedy token
        assert int(alone.argmax()) == int(batched.argmax())


def assert_kv_close(worker, a, b) -> None:
    """Per layer: a stored entry may move to a neighbouring number of the cache's dtype (one step at its
    magnitude, at most one at the layer's largest), plus what the moves before it did to the attention
    that produced it (less than one more; observed: none)."""
    assert a.num_tokens == b.num_tokens
    for (ka, va), (kb, vb) in zip(a.export_layers(), b.export_layers()):
        for x, y in ((ka, kb), (va, vb)):
            assert float((x.float() - y.float()).abs().max()) <= bound(worker, x.float(), steps=2)


def assert_same_bits(a, b) -> None:
    assert a.num_tokens == b.num_tokens
    for (ka, va), (kb, vb) in zip(a.export_layers(), b.export_layers()):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.fixture(scope="module", params=["auto", "bfloat16"])
def worker(request, tiny_model_dir):
    """The model's own dtype for the KV cache, and a bfloat16 KV cache (WorkerConfig.kv_dtype)."""
    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64,
                          kv_dtype=request.param)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


def histories(worker, count, base=90, seed=None):
    generator = torch.Generator().manual_seed(count if seed is None else seed)
    vocab = worker.model.config.vocab_size
    return [torch.randint(3, vocab, (base + 23 * i,), generator=generator).tolist() for i in range(count)]


def prefilled(worker, tokens):
    cache = worker.new_cache()
    worker.prefill(cache, tokens)
    return cache


PROMPT = list(range(10, 74))


def test_one_segment_is_exactly_a_decode(worker):
    history = histories(worker, 1)[0]
    a, b = prefilled(worker, history), prefilled(worker, history)
    assert torch.equal(worker.step([Segment(a, [7])])[0], worker.decode(b, 7))


def riding(worker, stories, new_tokens):
    """Each history prefilled alone, then all their `new_tokens` in one step: the logits and the caches."""
    caches = [prefilled(worker, h) for h in stories]
    return worker.step([Segment(cache, tokens) for cache, tokens in zip(caches, new_tokens)]), caches


def test_a_conversation_gets_the_same_bits_whatever_rides_with_it(worker):
    """Neighbours with other histories of other lengths, the same row counts: nothing of theirs reaches it,
    whether it is the prefill chunk or a decoder."""
    stories, others = histories(worker, 3), histories(worker, 3, base=40, seed=99)
    new_tokens = [PROMPT, [9], [9]]
    for index in range(2):
        mixed = [stories[i] if i == index else others[i] for i in range(3)]
        (logits, caches), (other_logits, other_caches) = riding(worker, stories, new_tokens), riding(worker, mixed, new_tokens)
        assert torch.equal(logits[index], other_logits[index])
        assert_same_bits(caches[index], other_caches[index])


def copied(worker, cache):
    return type(cache).from_layers([(k.clone(), v.clone()) for k, v in cache.export_layers()], worker.device)


def test_sessions_decoding_together_get_the_logits_and_kv_each_gets_alone(worker):
    """Twenty steps, every conversation fed the greedy token it chooses alone. Each step is compared with
    the same step taken alone from a copy of the same state (the differences of earlier steps, each within
    the bound, add up over twenty); the caches at the end with those kept alone all along."""
    stories = histories(worker, 4)
    alone = [prefilled(worker, h) for h in stories]
    together = [prefilled(worker, h) for h in stories]
    tokens = [5] * 4
    for _ in range(20):
        expected = [worker.step([Segment(copied(worker, cache), [t])])[0] for cache, t in zip(together, tokens)]
        got = worker.step([Segment(cache, [t]) for cache, t in zip(together, tokens)])
        for e, g in zip(expected, got):
            assert_logits_close(worker, e, g)
        for cache, t in zip(alone, tokens):
            worker.step([Segment(cache, [t])])
        tokens = [int(e.argmax()) for e in expected]
    for a, b in zip(alone, together):
        assert_kv_close(worker, a, b)


def test_a_prefill_chunk_riding_with_decodes_equals_the_same_chunk_alone(worker):
    stories = histories(worker, 3)
    alone = [prefilled(worker, h) for h in stories]
    together = [prefilled(worker, h) for h in stories]
    expected = [worker.step([Segment(alone[0], PROMPT)])[0]] + [
        worker.step([Segment(cache, [9])])[0] for cache in alone[1:]]
    got = worker.step([Segment(together[0], PROMPT)] + [Segment(cache, [9]) for cache in together[1:]])
    for e, g in zip(expected, got):
        assert_logits_close(worker, e, g)
    for a, b in zip(alone, together):
        assert_kv_close(worker, a, b)


def test_two_prefill_chunks_riding_together_equal_each_alone(worker):
    """Chunks of the same length over histories of different lengths: each its own causal mask."""
    stories = histories(worker, 3)
    new_tokens = [PROMPT, list(range(100, 164)), [9]]
    got, together = riding(worker, stories, new_tokens)
    for history, tokens, logits, cache in zip(stories, new_tokens, got, together):
        alone = prefilled(worker, history)
        assert_logits_close(worker, worker.step([Segment(alone, tokens)])[0], logits)
        assert_kv_close(worker, alone, cache)


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
        assert_logits_close(worker, e, g)
    unbiased = prefilled(worker, stories[0])
    assert float((worker.step([Segment(unbiased, [11, 12, 13])])[0] - got[0]).abs().max()) > bound(
        worker, got[0], steps=worker.num_layers)


def gathered_statistics(worker, stories, together: bool):
    caches = [worker.new_cache() for _ in stories]
    stats = [worker.new_stats() for _ in stories]
    if together:
        worker.step([Segment(c, h, s) for c, h, s in zip(caches, stories, stats)])
        for _ in range(8):
            worker.step([Segment(c, [5], s) for c, s in zip(caches, stats)])
    else:
        for cache, history, s in zip(caches, stories, stats):
            worker.step([Segment(cache, history, s)])
            for _ in range(8):
                worker.step([Segment(cache, [5], s)])
    return stats


def test_statistics_of_a_session_in_a_batch_are_those_it_gathers_alone(worker):
    """Gathered from the attention's probabilities, in float32 from the cache's queries and keys: a moved
    query or key moves them by at most a step at their magnitude (observed: 0)."""
    stories = histories(worker, 2)
    for alone, together in zip(gathered_statistics(worker, stories, False), gathered_statistics(worker, stories, True)):
        assert alone.distance_rows == together.distance_rows > 0
        for a, b in ((alone.ir_scores(), together.ir_scores()), (alone.key_scores, together.key_scores)):
            assert a.shape == b.shape and float((a - b).abs().max()) <= bound(worker, a, steps=1)


def test_statistics_do_not_depend_on_the_neighbours(worker):
    first = histories(worker, 2)[0]
    one = gathered_statistics(worker, [first, histories(worker, 1, base=113, seed=5)[0]], True)[0]
    other = gathered_statistics(worker, [first, histories(worker, 1, base=113, seed=6)[0]], True)[0]
    assert torch.equal(one.key_scores, other.key_scores) and torch.equal(one.ir_scores(), other.ir_scores())
    assert torch.equal(one.distances(), other.distances())


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
    one_shot_cache = worker.new_cache()
    with torch.inference_mode():
        one_shot = worker.model(input_ids=torch.tensor([prompt]), past_key_values=one_shot_cache,
                                use_cache=True).logits[0, -1]
    assert_logits_close(worker, one_shot, logits)
    assert_kv_close(worker, one_shot_cache, cache)


# Deliberately wrong batched attentions: each is installed in place of batch_forward.attention for one test.

def _attend(module, query, key, value, attention_mask, kwargs, keys_values, mask):
    """batch_forward.attention with the keys, values and mask of conversation i given by the two functions."""
    segments = batch_forward._batch.get()
    if segments is None:  # a forward of one conversation, as usual
        return batch_forward.attention(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for index, segment in enumerate(segments):
        keys, values = keys_values(segments, index, module.layer_idx)
        with attention_stats.collecting(segment.stats), attention_stats.head_bias(segment.bias):
            output, _ = attention_stats.attention_with_stats(module, query[:, :, segment.start : segment.end], keys,
                                                             values, mask(segments, index, keys.shape[2]), **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


def _own_keys(segments, index, layer_idx):
    layer = segments[index].cache.layers[layer_idx]
    return layer.keys, layer.values


def without_masks(module, query, key, value, attention_mask, **kwargs):
    """Every conversation attends with no mask of its own (SDPA's causal default): a prefill chunk with
    history behind it then sees the wrong keys."""
    return _attend(module, query, key, value, attention_mask, kwargs, _own_keys, lambda segments, index, keys: None)


def with_another_conversations_mask(module, query, key, value, attention_mask, **kwargs):
    """Each conversation takes the next one's mask, cut or padded (nothing allowed) to its own keys."""
    def mask(segments, index, num_keys):
        other = segments[(index + 1) % len(segments)]
        if other.mask is None or len(other.token_ids) != len(segments[index].token_ids):
            return segments[index].mask
        width = other.mask.shape[-1]
        if width >= num_keys:
            return other.mask[..., :num_keys]
        return torch.nn.functional.pad(other.mask, (0, num_keys - width), value=False)
    return _attend(module, query, key, value, attention_mask, kwargs, _own_keys, mask)


def leaking_one_key(module, query, key, value, attention_mask, **kwargs):
    """Each decoder also sees the newest key and value of the next conversation: one row of leak."""
    def keys_values(segments, index, layer_idx):
        keys, values = _own_keys(segments, index, layer_idx)
        if len(segments[index].token_ids) > 1:
            return keys, values
        other_keys, other_values = _own_keys(segments, (index + 1) % len(segments), layer_idx)
        return torch.cat([keys, other_keys[:, :, -1:]], dim=2), torch.cat([values, other_values[:, :, -1:]], dim=2)
    return _attend(module, query, key, value, attention_mask, kwargs, keys_values, lambda segments, index, keys: segments[index].mask)


@pytest.fixture
def broken(worker):
    """Installs a wrong batched attention on the worker's model for one test."""
    def install(attention):
        attention_stats.install(worker.model, attention)
    yield install
    attention_stats.install(worker.model, batch_forward.attention)


def test_a_batched_attention_without_masks_is_caught(worker, broken):
    broken(without_masks)
    with pytest.raises(AssertionError):
        test_a_prefill_chunk_riding_with_decodes_equals_the_same_chunk_alone(worker)


def test_a_batched_attention_with_another_conversations_mask_is_caught(worker, broken):
    broken(with_another_conversations_mask)
    with pytest.raises(AssertionError):
        test_two_prefill_chunks_riding_together_equal_each_alone(worker)


def test_a_batched_attention_that_leaks_one_key_is_caught(worker, broken):
    broken(leaking_one_key)
    with pytest.raises(AssertionError):
        test_a_conversation_gets_the_same_bits_whatever_rides_with_it(worker)
    with pytest.raises(AssertionError):
        test_sessions_decoding_together_get_the_logits_and_kv_each_gets_alone(worker)
