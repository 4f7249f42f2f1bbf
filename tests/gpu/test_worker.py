"""The model worker's own forwards on the GPU. Marked `cuda`: skipped without a GPU."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from statekeeper.config import WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker
from tests.conftest import MODEL_CACHE
from tests.statekeeper.restore_cases import TOKENS

pytestmark = pytest.mark.cuda


def test_decode_steps_build_no_cudnn_attention_graph_per_kv_length(tiny_model_dir):
    # cuDNN's attention (PyTorch's first choice on an H100, in 16-bit dtypes) builds a graph per shape, and
    # each decode step's KV length is new: 74 ms a call on the host with the GPU idle (BENCHMARKS.md).
    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=MODEL_CACHE, prefill_chunk_tokens=64,
                          device="cuda", dtype="bfloat16")
    worker = ModelWorker(load_model(config.model, config.model_cache_dir, config.device, config.dtype), config)
    cache = worker.new_cache()
    logits = worker.prefill(cache, TOKENS)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            logits = worker.decode(cache, int(logits.argmax()))
        torch.cuda.synchronize()
    kernels = [event.key for event in prof.key_averages()]
    assert kernels, "the profiler saw no CUDA kernel"
    assert not [name for name in kernels if "cudnn" in name.lower()]
