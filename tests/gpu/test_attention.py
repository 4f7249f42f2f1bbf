"""The biased prefill attention of a restored per-head state on the GPU (GQA packed) against the plain
reference. Marked `cuda`: skipped without a GPU (its CPU twin: tests/statekeeper/compression)."""

import math

import pytest
import torch

from statekeeper.compression.attention_stats import _biased_attention, _biased_attention_reference

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_queries", [48, 300])
def test_a_biased_prefill_on_the_device_matches_the_reference(dtype, num_queries):
    torch.manual_seed(0)
    query_heads, kv_heads, head_dim, history = 32, 8, 128, 2000
    num_keys = history + num_queries
    device = "cuda"
    query = torch.randn(1, query_heads, num_queries, head_dim, device=device, dtype=dtype)
    key = torch.randn(1, kv_heads, num_keys, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    bias = torch.zeros(kv_heads, num_keys + 64, device=device, dtype=dtype)  # a cache's buffer, zero past the history
    bias[:, :history].masked_fill_(torch.rand(kv_heads, history, device=device) < 0.6, -math.inf)
    bias[:, :history] += torch.where(torch.rand(kv_heads, history, device=device) < 0.2, math.log(3.0), 0.0).to(dtype)
    causal = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(history)[None, None]
    fast, _ = _biased_attention(query, key, value, causal, bias, head_dim**-0.5)
    reference, _ = _biased_attention_reference(query, key, value, causal, bias, head_dim**-0.5)
    assert fast.shape == reference.shape == (1, num_queries, query_heads, head_dim)
    # Both accumulate in float32 in another order; bfloat16 rounds each output once more (8-bit mantissa).
    spacing = 2**-7 if dtype == torch.bfloat16 else 2**-16
    assert torch.allclose(fast.float(), reference.float(), atol=spacing, rtol=spacing)
