"""One forward for several conversations, each with its own KV cache: their new tokens are packed into
one row sequence, so the projections and the MLP run as one matrix product over all rows (decode on a
CPU is bound by reading the weights, so a step of 8 rows costs far less than 8 steps), while attention
runs per conversation against that conversation's own cache, mask, attention bias and statistics.

Nothing is copied into a padded batch tensor: the model's own decoder layers run unchanged, the packed
rows' keys and values are appended to each conversation's KVCache by `PackedCaches.update`, and the
attention function (registered by compression/attention_stats.install) calls `attention` here, which
slices each conversation's queries out of the packed ones and attends to its cache exactly as an
unbatched forward would (the same function, the same mask, the same shapes): a conversation's attention
is the same in a batch as alone; only the matrix products see more rows (BENCHMARKS.md "Batch
invariance")."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from statekeeper.compression.attention_stats import AttentionStats, attention_with_stats, collecting, head_bias
from statekeeper.kv_cache import KVCache

_batch: contextvars.ContextVar["list[Segment] | None"] = contextvars.ContextVar("statekeeper_batch", default=None)

# A 4-D mask is passed through by transformers' mask builder untouched: the packed forward builds each
# conversation's own mask in `attention`, and this stands in for the one the model would build.
_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


@dataclass(slots=True)
class Segment:
    """One conversation's rows in a packed forward."""

    cache: KVCache
    token_ids: list[int]
    stats: AttentionStats | None = None
    start: int = 0  # its first row in the packed sequence
    past: int = 0  # tokens its cache held before this forward
    mask: torch.Tensor | None = field(default=None, repr=False)
    bias: list | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class PackedCaches(Cache):
    """Stands in for the cache during a packed forward: each layer's new keys and values go, row range by
    row range, to the conversations' own caches."""

    def __init__(self, segments: list[Segment], num_layers: int):
        super().__init__(layers=[DynamicLayer() for _ in range(num_layers)])  # only for the mask builder's checks
        self.segments = segments

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        for segment in self.segments:
            segment.cache.layers[layer_idx].update(key_states[:, :, segment.start : segment.end],
                                                   value_states[:, :, segment.start : segment.end])
        return key_states, value_states  # unused: `attention` reads each conversation's cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _causal_mask(num_queries: int, past: int, device: torch.device) -> torch.Tensor | None:
    """The mask transformers would build for this conversation alone: none for one query or an empty past
    (SDPA's is_causal covers it), else queries see the past and their own keys causally."""
    if num_queries == 1 or past == 0:
        return None
    allowed = torch.ones(num_queries, past + num_queries, dtype=torch.bool, device=device).tril(past)
    return allowed[None, None]


def attention(module, query, key, value, attention_mask, **kwargs):
    """The registered attention function: per conversation in a packed forward, else as usual."""
    segments = _batch.get()
    if segments is None:
        return attention_with_stats(module, query, key, value, attention_mask, **kwargs)
    outputs = []
    for segment in segments:
        layer = segment.cache.layers[module.layer_idx]
        with collecting(segment.stats), head_bias(segment.bias):
            output, _ = attention_with_stats(module, query[:, :, segment.start : segment.end], layer.keys,
                                             layer.values, segment.mask, **kwargs)
        outputs.append(output)
    return torch.cat(outputs, dim=1), None


@torch.inference_mode()
def packed_forward(model, segments: list[Segment], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Appends every segment's tokens to its cache in one forward; returns [segments, vocab] logits, each
    segment's last position."""
    start = 0
    positions = []
    for segment in segments:
        segment.start, segment.past = start, segment.cache.num_tokens
        segment.mask = _causal_mask(len(segment.token_ids), segment.past, device)
        segment.bias = segment.cache.attention_bias(segment.past + len(segment.token_ids), dtype)
        positions.append(torch.arange(segment.past, segment.past + len(segment.token_ids)))
        start = segment.end
    input_ids = torch.tensor([[token for segment in segments for token in segment.token_ids]], device=device)
    last_rows = torch.tensor([segment.end - 1 for segment in segments], device=device)
    token = _batch.set(segments)
    try:
        output = model(input_ids=input_ids, position_ids=torch.cat(positions)[None].to(device),
                       attention_mask=_NO_MASK, past_key_values=PackedCaches(segments, len(segments[0].cache.layers)),
                       use_cache=True, logits_to_keep=last_rows)
    finally:
        _batch.reset(token)
    return output.logits[0].float()


def supports_packing(model) -> bool:
    """Packed forwards need every layer to attend to its whole cache (no sliding windows, no linear or
    recurrent layers), as the per-conversation masks here assume."""
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    layer_types = getattr(config, "layer_types", None)
    return not layer_types or all(kind == "full_attention" for kind in layer_types)
