import pytest
import torch

from statekeeper.worker import ModelWorker


def test_greedy_picks_the_argmax():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert ModelWorker.sample(logits, 0.0, 1.0, None) == 1


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed():
    logits = torch.zeros(50)

    def draws(seed):
        generator = torch.Generator().manual_seed(seed)
        return [ModelWorker.sample(logits, 1.0, 1.0, generator) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    picks = {ModelWorker.sample(logits, 1.0, 0.7, generator) for _ in range(300)}
    assert picks == {0, 1}  # 0.5 + 0.3 reaches 0.7; tokens 2 and 3 are never drawn
    picks = {ModelWorker.sample(logits, 1.0, 0.01, generator) for _ in range(50)}
    assert picks == {0}


def test_prefill_in_chunks_matches_one_shot(tiny_worker):
    tokens = list(range(3, 200))
    chunked = tiny_worker.new_cache()
    logits_chunked = tiny_worker.prefill(chunked, tokens)  # 64-token chunks in the tiny worker
    one_shot = tiny_worker.new_cache()
    with torch.inference_mode():
        logits = tiny_worker.model(input_ids=torch.tensor([tokens]), past_key_values=one_shot, use_cache=True).logits
    assert torch.allclose(logits_chunked, logits[0, -1], atol=1e-4)
    assert chunked.num_tokens == len(tokens)


def test_worker_reads_the_model_shape(tiny_worker):
    assert tiny_worker.num_layers == 4 and tiny_worker.num_kv_heads == 2 and tiny_worker.head_dim == 16
    assert tiny_worker.kv_bytes_per_token == 2 * 4 * 2 * 16 * 4
    assert tiny_worker.stop_token_ids == {tiny_worker.tokenizer.eos_token_id}


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-30])
@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_tiny_temperature_samples_the_top_token_instead_of_failing(temperature, top_p):
    """Found by the schema fuzz: logits / 1e-300 overflowed to inf and softmax gave NaN (a 500)."""
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    generator = torch.Generator().manual_seed(0)
    assert ModelWorker.sample(logits, temperature, top_p, generator) == 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-30])
def test_a_tiny_top_p_keeps_the_top_token(top_p):
    """Also found by the fuzz: a top_p that is 0 in float32 dropped every token (multinomial of zeros)."""
    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    generator = torch.Generator().manual_seed(0)
    assert {ModelWorker.sample(logits, 1.0, top_p, generator) for _ in range(20)} == {1}


def test_a_prefill_that_gives_way_leaves_the_cache_and_stats_as_they_were_and_runs_again_the_same(tiny_worker):
    """A background prefill asked to give way part way through its layers stops there: every layer holds the rows
    it held before (not the first layers' new ones), the attention statistics count none of its rows, and run
    again it leaves the same rows, bit for bit, as a prefill that never stopped."""
    from statekeeper.kv_cache import GaveWay

    history, piece = list(range(3, 40)), list(range(40, 90))
    cache, stats = tiny_worker.new_cache(), tiny_worker.new_stats()
    tiny_worker.prefill(cache, history, stats)
    before_rows = [(keys.clone(), values.clone()) for keys, values in cache.export_layers()]
    before_stats = stats.snapshot()
    checks = []

    def live_work_after_two_layers() -> bool:
        checks.append(None)
        return len(checks) > 2

    with pytest.raises(GaveWay):
        tiny_worker.prefill(cache, piece, stats, live_work_after_two_layers)
    assert len(checks) == 3  # stopped before the third layer wrote its rows
    assert [layer.length for layer in cache.layers] == [len(history)] * tiny_worker.num_layers
    for (keys, values), (kept_keys, kept_values) in zip(before_rows, cache.export_layers()):
        assert torch.equal(keys, kept_keys) and torch.equal(values, kept_values)
    assert torch.equal(stats.key_scores, before_stats.key_scores)
    assert torch.equal(stats.sq_distance, before_stats.sq_distance) and stats.distance_rows == before_stats.distance_rows

    again = tiny_worker.prefill(cache, piece, stats, lambda: False)
    never_stopped, never_stopped_stats = tiny_worker.new_cache(), tiny_worker.new_stats()
    tiny_worker.prefill(never_stopped, history, never_stopped_stats)
    expected = tiny_worker.prefill(never_stopped, piece, never_stopped_stats)
    assert torch.equal(again, expected)
    for (keys, values), (other_keys, other_values) in zip(cache.export_layers(), never_stopped.export_layers()):
        assert torch.equal(keys, other_keys) and torch.equal(values, other_values)
    assert torch.equal(stats.key_scores, never_stopped_stats.key_scores)
    assert torch.equal(stats.ir_mass, never_stopped_stats.ir_mass)


def test_a_background_prefill_on_a_model_thread_gives_way_to_live_work_submitted_meanwhile(tiny_worker):
    """The background job checks its thread's line between layers: a live job submitted while it runs starts
    after one more layer, not after the whole job, and the job leaves the cache as it found it."""
    from scheduler.model_thread import ModelThread
    from statekeeper.kv_cache import GaveWay

    thread, order = ModelThread(), []
    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, list(range(3, 40)))

    def live_work_comes_at_the_first_layer() -> bool:
        if not order:
            order.append("live job submitted")
            thread.submit(order.append, "live job ran")
        return thread.live_waiting()

    def background_job():
        try:
            tiny_worker.prefill(cache, list(range(40, 90)), None, live_work_comes_at_the_first_layer)
        except GaveWay:
            order.append("background job gave way")
            return
        order.append("background job ended")

    thread.submit_background(background_job).result(timeout=30)
    thread.shutdown(wait=True)
    assert order == ["live job submitted", "background job gave way", "live job ran"]
    assert cache.num_tokens == 37 and thread.live_waiting() is False


def test_a_prefill_that_gives_way_past_a_capacity_boundary_keeps_the_buffers_it_had(tiny_worker):
    """A job that grew the layers it reached past a capacity boundary and then gave way put them back by a cut,
    which shrinks: a new buffer and a copy of every row, for each layer, while the live work waited."""
    from statekeeper.kv_cache import CHUNK_TOKENS, GaveWay

    cache = tiny_worker.new_cache()
    tiny_worker.prefill(cache, list(range(3, 3 + CHUNK_TOKENS - 6)))
    buffers = [(keys.data_ptr(), values.data_ptr()) for keys, values in cache.export_layers()]
    allocated, checks = cache.allocated_bytes, []

    def live_work_at_the_last_layer() -> bool:
        checks.append(None)
        return len(checks) == tiny_worker.num_layers

    with pytest.raises(GaveWay):
        tiny_worker.prefill(cache, list(range(300, 320)), None, live_work_at_the_last_layer)
    assert cache.num_tokens == CHUNK_TOKENS - 6 and cache.allocated_bytes == allocated
    assert [(keys.data_ptr(), values.data_ptr()) for keys, values in cache.export_layers()] == buffers
