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
