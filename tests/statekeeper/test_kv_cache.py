import torch
from transformers import DynamicCache

from statekeeper.kv_cache import CHUNK_TOKENS, KVCache, capacity_for


def _forward(worker, cache, tokens):
    with torch.inference_mode():
        out = worker.model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    return out.logits[0]


def test_capacity_grows_in_whole_chunks():
    assert capacity_for(0) == CHUNK_TOKENS
    assert capacity_for(CHUNK_TOKENS) == CHUNK_TOKENS
    assert capacity_for(CHUNK_TOKENS + 1) == 2 * CHUNK_TOKENS


def test_growable_cache_matches_transformers_dynamic_cache(tiny_worker):
    tokens = list(range(5, 305))  # crosses a chunk boundary
    ours, reference = KVCache(tiny_worker.num_layers), DynamicCache()
    for piece in (tokens[:200], tokens[200:260], [7], [8], tokens[260:]):
        assert torch.allclose(_forward(tiny_worker, ours, piece), _forward(tiny_worker, reference, piece), atol=1e-5)
    assert ours.num_tokens == reference.get_seq_length() == len(tokens) + 2
    for (keys, values), layer in zip(ours.export_layers(), reference.layers):
        assert torch.equal(keys, layer.keys[0]) and torch.equal(values, layer.values[0])


def test_export_then_import_is_identical_with_same_layout(tiny_worker):
    cache = KVCache(tiny_worker.num_layers)
    _forward(tiny_worker, cache, list(range(3, 300)))
    restored = KVCache.from_layers(cache.export_layers(), torch.device("cpu"))
    assert restored.num_tokens == cache.num_tokens
    assert restored.allocated_bytes == cache.allocated_bytes
    for (k1, v1), (k2, v2) in zip(cache.export_layers(), restored.export_layers()):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
        assert k1.stride() == k2.stride()
    after_a = _forward(tiny_worker, cache, [11, 12])
    after_b = _forward(tiny_worker, restored, [11, 12])
    assert torch.equal(after_a, after_b)


def test_truncate_rolls_back_and_shrinks_capacity(tiny_worker):
    cache = KVCache(tiny_worker.num_layers)
    _forward(tiny_worker, cache, list(range(3, 100)))
    before = [k.clone() for k, _ in cache.export_layers()]
    _forward(tiny_worker, cache, list(range(3, 300)))
    cache.truncate(97)
    assert cache.num_tokens == 97
    assert cache.allocated_bytes == KVCache.from_layers(cache.export_layers(), torch.device("cpu")).allocated_bytes
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, cache.export_layers()))


def _prefilled_with_bias(worker, evicted: slice) -> tuple[KVCache, list[torch.Tensor]]:
    """A 200-token cache, and a per-layer bias that evicts `evicted` from every head."""
    cache = KVCache(worker.num_layers)
    _forward(worker, cache, list(range(3, 203)))
    bias = [torch.zeros(worker.num_kv_heads, 200) for _ in range(worker.num_layers)]
    for layer in bias:
        layer[:, evicted] = -torch.inf
    return cache, bias


def test_attention_bias_buffers_are_built_once_and_follow_the_cache(tiny_worker):
    cache, bias = _prefilled_with_bias(tiny_worker, slice(50, 60))
    for layer in bias:
        layer[0, 70] = 0.5
    restored = KVCache.from_layers(cache.export_layers(), torch.device("cpu"), bias)
    buffers = restored.attention_bias(201, torch.float32)
    assert len(buffers) == tiny_worker.num_layers
    for buffer, layer in zip(buffers, bias):
        assert buffer.shape == (tiny_worker.num_kv_heads, CHUNK_TOKENS)
        assert torch.equal(buffer[:, :200], layer) and not buffer[:, 200:].any()  # new tokens: unbiased
    assert restored.attention_bias(CHUNK_TOKENS, torch.float32) is buffers  # decode steps reuse them
    grown = restored.attention_bias(CHUNK_TOKENS + 1, torch.float32)  # the cache outgrew its capacity
    assert grown[0].shape[1] == 2 * CHUNK_TOKENS and torch.equal(grown[0][:, :200], bias[0])
    restored.truncate(55)
    truncated = restored.attention_bias(56, torch.float32)
    assert truncated[0].shape[1] == CHUNK_TOKENS
    assert torch.equal(truncated[0][:, :55], bias[0][:, :55]) and not truncated[0][:, 55:].any()
    assert restored.attention_bias(56, torch.float16)[0].dtype == torch.float16
    restored.head_bias = None
    assert restored.attention_bias(56, torch.float32) is None


def test_a_reply_bias_waits_for_the_reply_and_is_cut_with_the_rows(tiny_worker):
    cache, working_set = _prefilled_with_bias(tiny_worker, slice(50, 150))
    whole = KVCache.from_layers(cache.export_layers(), torch.device("cpu"))
    restored = KVCache.from_layers(cache.export_layers(), torch.device("cpu"))
    restored.reply_bias = working_set

    def forward(cache, tokens):  # as a turn runs it: the cache's bias applies
        with torch.inference_mode():
            return tiny_worker.run_model(cache, torch.tensor([tokens])).logits[0]

    prompt = list(range(210, 220))
    assert torch.equal(forward(restored, prompt), forward(whole, prompt))  # the prompt attends every row
    assert restored.attention_bias(211, torch.float32) is None
    restored.begin_reply()
    assert restored.head_bias is working_set and restored.reply_bias is None
    assert not torch.equal(forward(restored, [250]), forward(whole, [250]))  # the reply, the working set
    restored.begin_reply()  # nothing left to apply
    assert restored.head_bias is working_set
    pending = KVCache.from_layers(cache.export_layers(), torch.device("cpu"))
    pending.reply_bias = working_set
    pending.truncate(120)
    assert [bias.shape[1] for bias in pending.reply_bias] == [120] * tiny_worker.num_layers


def test_a_prefix_copy_keeps_the_bias_and_the_pending_working_set_cut_there(tiny_worker):
    cache, working_set = _prefilled_with_bias(tiny_worker, slice(50, 150))
    evicted = [bias.clone() for bias in working_set]
    for bias in evicted:
        bias[:, 10:20] = -torch.inf
    restored = KVCache.from_layers(cache.export_layers(), torch.device("cpu"), evicted)
    restored.reply_bias = working_set
    branch = restored.prefix_copy(120, torch.device("cpu"))
    assert branch.num_tokens == 120 and torch.equal(branch.export_layers()[0][0], cache.export_layers()[0][0][:, :120])
    assert all(torch.equal(copied, bias[:, :120]) for copied, bias in zip(branch.head_bias, evicted))
    assert all(torch.equal(copied, bias[:, :120]) for copied, bias in zip(branch.reply_bias, working_set))
    branch.begin_reply()  # the branch's reply attends the working set, as the conversation's would
    assert all(torch.equal(copied, bias[:, :120]) for copied, bias in zip(branch.head_bias, working_set))
    # The source is left as it was: its bias and its pending working set, whole.
    assert restored.reply_bias is working_set and all(b.shape[1] == 200 for b in restored.head_bias)
