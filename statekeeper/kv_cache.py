"""The KV cache the service controls: per layer K and V in capacity buffers that grow in fixed chunks,
exported to storage and imported back byte for byte.

Capacity is a pure function of the length (`capacity_for`), so a session restored from storage has the
same buffer layout (and so the same attention kernels and strides) as one that never left memory."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

CHUNK_TOKENS = 256
_give_way: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("statekeeper_give_way",
                                                                                      default=None)


class GaveWay(Exception):
    """A forward stopped between two layers because live work waits for its thread (`giving_way`)."""


@contextmanager
def giving_way(check: Callable[[], bool]):
    """Forwards on this thread meanwhile stop before any layer's keys and values are written where `check()`
    says live work waits (GaveWay): a background job then holds a returning user's prompt up for one layer,
    not the whole job. The cache is left with some layers longer than others: the caller puts it back
    (KVCache.mark, rollback)."""
    token = _give_way.set(check)
    try:
        yield
    finally:
        _give_way.reset(token)


def capacity_for(num_tokens: int) -> int:
    return max(CHUNK_TOKENS, -(-num_tokens // CHUNK_TOKENS) * CHUNK_TOKENS)


class GrowableLayer(DynamicLayer):
    """A DynamicLayer that appends in place instead of re-concatenating the whole cache at every step, in
    `dtype` if given (the worker's kv_dtype: keys and values are cast as they are written), else in the
    dtype of the first keys it gets."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.buffer_dtype = dtype
        self.length = 0
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.buffer_dtype or key_states.dtype, key_states.device
        self.is_initialized = True

    def _resize(self, num_tokens: int, like_key: torch.Tensor, like_value: torch.Tensor) -> None:
        capacity = capacity_for(num_tokens)
        if self._key_buf is not None and self._key_buf.shape[-2] == capacity:
            return
        batch, heads, _, key_dim = like_key.shape
        key_buf = like_key.new_empty(batch, heads, capacity, key_dim, dtype=self.dtype)
        value_buf = like_value.new_empty(batch, heads, capacity, like_value.shape[-1], dtype=self.dtype)
        keep = min(self.length, num_tokens)
        if self._key_buf is not None and keep:
            key_buf[..., :keep, :].copy_(self._key_buf[..., :keep, :])
            value_buf[..., :keep, :].copy_(self._value_buf[..., :keep, :])
        self._key_buf, self._value_buf = key_buf, value_buf

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buf[..., :length, :]
        self.values = self._value_buf[..., :length, :]

    # Every mutation runs in inference mode: buffers made by a forward are inference tensors, and
    # in-place updates to them are only allowed there.
    @torch.inference_mode()
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if self._key_buf is None or end > self._key_buf.shape[-2]:
            self._resize(end, key_states, value_states)
        self._key_buf[..., start:end, :].copy_(key_states)
        self._value_buf[..., start:end, :].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    @torch.inference_mode()
    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replaces the content with `keys`/`values` of shape [heads, tokens, dim] (copied)."""
        self.lazy_initialization(keys, values)
        self.length = 0
        self._key_buf = None
        self._resize(keys.shape[-2], keys.unsqueeze(0), values.unsqueeze(0))
        self._key_buf[0, :, : keys.shape[-2]].copy_(keys)
        self._value_buf[0, :, : values.shape[-2]].copy_(values)
        self._set_length(keys.shape[-2])

    @torch.inference_mode()
    def reserve(self, num_tokens: int, keys_like: torch.Tensor, values_like: torch.Tensor) -> None:
        """Empty buffers for `num_tokens` shaped like [heads, *, dim] `keys_like` / `values_like`, so a
        loader can write rows while a forward appends the first ones (restore pipeline)."""
        self.lazy_initialization(keys_like, values_like)
        self.length, self._key_buf = 0, None
        self._resize(num_tokens, keys_like.unsqueeze(0), values_like.unsqueeze(0))
        self._set_length(0)

    @torch.inference_mode()
    def write_rows(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copies [heads, n, dim] rows to positions [start, start + n) of the reserved buffers."""
        end = start + keys.shape[-2]
        self._key_buf[0, :, start:end].copy_(keys)
        self._value_buf[0, :, start:end].copy_(values)

    @torch.inference_mode()
    def adopt(self, key_buf: torch.Tensor, value_buf: torch.Tensor) -> None:
        """Empty, over the given [1, heads, capacity, dim] buffers (views of a stacked allocation: a restore
        writes every layer's rows with one operation, KVCache.reserve_stacked)."""
        self.dtype, self.device, self.is_initialized = key_buf.dtype, key_buf.device, True
        self._key_buf, self._value_buf = key_buf, value_buf
        self._set_length(0)

    def reserved_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [start, end) of the reserved buffers as writable [heads, n, dim] views (a GPU restore's
        copies land there: statekeeper/device_restore.py)."""
        return self._key_buf[0, :, start:end], self._value_buf[0, :, start:end]

    @torch.inference_mode()
    def zeroed_rows(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [0, num_tokens) of the reserved buffers, zero-filled, as writable [heads, num_tokens, dim]
        views: a layer-by-layer restore scatters a compressed state's kept rows into them (the evicted
        entries stay zero, hidden by the bias; uninitialised memory could hold NaN, which a zero attention
        weight does not hide)."""
        keys, values = self._key_buf[0, :, :num_tokens], self._value_buf[0, :, :num_tokens]
        keys.zero_()
        values.zero_()
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    @torch.inference_mode()
    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.length + max_length
        if self._key_buf is None or max_length >= self.length:
            return
        self._resize(max_length, self._key_buf, self._value_buf)  # shrink too: capacity stays capacity_for(length)
        self._set_length(max_length)

    def put_back(self, key_buf: torch.Tensor | None, value_buf: torch.Tensor | None, length: int) -> None:
        """The buffers and length this layer had (KVCache.mark): rows written since were past `length`, or
        into buffers it grew into since (a growth copies, the old buffers are as they were)."""
        if key_buf is None:
            self.reset()
            return
        self._key_buf, self._value_buf = key_buf, value_buf
        self._set_length(length)

    def reset(self) -> None:
        self.length = 0
        self._key_buf = self._value_buf = None
        self.keys = self.values = None
        self.is_initialized = False

    @property
    def allocated_bytes(self) -> int:
        if self._key_buf is None:
            return 0
        return self._key_buf.nbytes + self._value_buf.nbytes


class KVCache(Cache):
    """One GrowableLayer per decoder layer; batch size is always 1 (one conversation)."""

    def __init__(self, num_layers: int, dtype: torch.dtype | None = None):
        super().__init__(layers=[GrowableLayer(dtype) for _ in range(num_layers)])
        # The shortest prefix this state may be cut to and stay exact: a state restored from storage on a
        # model with sliding-window layers holds zeros where each such layer's rows fell out of its window,
        # and a shorter prefix would attend to some of them. A cut below it drops every row (recomputed).
        self.min_cut = 0
        self._head_bias: list[torch.Tensor] | None = None
        self._bias_buffers: list[torch.Tensor] | None = None  # built from head_bias once, see attention_bias
        # A working set's bias that becomes head_bias when the reply begins (begin_reply): a restore that read
        # every exact row lets the turn's prompt attend all of them and the reply only the working set (issue
        # 33: the new message is where attention moves most). Cut with the rows (truncate).
        self.reply_bias: list[torch.Tensor] | None = None
        # During that reply: the bias its prompt attended, which end_reply puts back (the rows stay exact)
        self._prompt_bias: tuple[list[torch.Tensor] | None] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        check = _give_way.get()
        if check is not None and check():
            raise GaveWay
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @property
    def head_bias(self) -> list[torch.Tensor] | None:
        """Per layer [kv_heads, history tokens] attention bias of a state restored from per-head eviction
        (compression/head_budget.py): -inf evicted, log(votes) merged; positions past it are unbiased.
        Replace it (assign), never modify it in place: the attention buffers are rebuilt on assignment."""
        return self._head_bias

    @head_bias.setter
    def head_bias(self, bias: list[torch.Tensor] | None) -> None:
        self._head_bias, self._bias_buffers = bias, None

    def begin_reply(self) -> None:
        """The prompt is in: from here on the cache attends the working set `reply_bias` names, if any."""
        if self.reply_bias is not None:
            self._prompt_bias = (self.head_bias,)
            self.head_bias, self.reply_bias = self.reply_bias, None

    def end_reply(self) -> None:
        """The reply is in: the working set was that reply's, and every row the restore read is still exact
        here, so the cache attends them again (as the state it stores, and reads back, does)."""
        if self._prompt_bias is not None:
            (prompt_bias,), self._prompt_bias = self._prompt_bias, None
            self.head_bias = None if prompt_bias is None else [bias[:, : self.num_tokens] for bias in prompt_bias]

    @property
    def biases(self) -> tuple:
        """What the cache attends, as `restore_biases` puts it back (a turn or a score that did not finish)."""
        return self.head_bias, self.reply_bias, self._prompt_bias

    def restore_biases(self, biases: tuple) -> None:
        self.head_bias, self.reply_bias, self._prompt_bias = biases

    def attention_bias(self, num_tokens: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
        """head_bias as the attention reads it: per layer [kv_heads, width >= num_tokens] in `dtype`, zero
        past the history. Built once and reused by every forward until the cache outgrows it (width is a
        capacity, so that happens once per CHUNK_TOKENS) or head_bias is replaced: a decode step slices a
        view instead of building a mask (compression/attention_stats.py `_biased_attention`)."""
        if self._head_bias is None:
            return None
        buffers = self._bias_buffers
        if buffers is None or buffers[0].shape[1] < num_tokens or buffers[0].dtype != dtype:
            width = capacity_for(max(num_tokens, max(bias.shape[1] for bias in self._head_bias)))
            buffers = []
            for bias in self._head_bias:
                buffer = bias.new_zeros(bias.shape[0], width, dtype=dtype)
                buffer[:, : bias.shape[1]] = bias
                buffers.append(buffer)
            self._bias_buffers = buffers
        return buffers

    def reserve_stacked(self, num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """As `reserve`, with every layer's buffers views of one [layers, heads, capacity, dim] tensor for K
        and one for V (returned), so a restore scatters many layers' rows in one operation. A layer that
        outgrows its capacity later moves to buffers of its own."""
        capacity, num_layers = capacity_for(num_tokens), len(self.layers)
        keys = torch.empty(num_layers, num_heads, capacity, head_dim, dtype=dtype, device=device)
        values = torch.empty_like(keys)
        for index, layer in enumerate(self.layers):
            layer.adopt(keys[index: index + 1], values[index: index + 1])
        return keys, values

    def reserve_bias(self, num_heads: int, history_tokens: int, num_tokens: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(head_bias [layers, heads, history_tokens] float32, attention buffers [layers, heads, width] in
        `dtype`, wide enough for `num_tokens`), zeroed, for a restore to fill in place; head_bias and the
        buffers `attention_bias` reads become their per-layer views. A GPU restore writes them on its copy
        stream before each layer's event, so no forward rebuilds the buffers from every layer's bias."""
        width = capacity_for(num_tokens)
        biases = torch.zeros(len(self.layers), num_heads, history_tokens, device=device)
        buffers = torch.zeros(len(self.layers), num_heads, width, dtype=dtype, device=device)
        self._head_bias, self._bias_buffers = list(biases.unbind(0)), list(buffers.unbind(0))
        return biases, buffers

    @torch.inference_mode()
    def write_rows(self, rows: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """History rows written in place, each (layer, head, positions, keys [n, d], values [n, d]), and attended
        from now on (bias 0): exact entries a retrieval brought back (compression/retrieval.py)."""
        bias = list(self._head_bias) if self._head_bias is not None else None
        for layer, head, positions, keys, values in rows:
            target = self.layers[layer]
            target._key_buf[0, head, positions] = keys.to(target._key_buf.dtype)
            target._value_buf[0, head, positions] = values.to(target._value_buf.dtype)
            if bias is not None:
                if bias[layer] is self._head_bias[layer]:  # replaced, never modified in place (head_bias)
                    bias[layer] = bias[layer].clone()
                bias[layer][head, positions] = 0.0
        if bias is not None:
            self.head_bias = bias

    @property
    def num_tokens(self) -> int:
        return self.layers[0].length

    @property
    def allocated_bytes(self) -> int:
        return sum(layer.allocated_bytes for layer in self.layers)

    def export_layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views (no copy) of each layer's K and V, shape [kv_heads, tokens, head_dim]."""
        return [(layer.keys[0], layer.values[0]) for layer in self.layers]

    @classmethod
    def from_layers(cls, layers: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                    head_bias: list[torch.Tensor] | None = None) -> "KVCache":
        cache = cls(len(layers))
        for layer, (keys, values) in zip(cache.layers, layers):
            # Blocking: the layers may be views of a tier's pinned memory (a GPU worker's DRAM tier), which
            # nothing here keeps alive until an asynchronous copy would have read it.
            layer.load(keys.to(device), values.to(device))
        if head_bias is not None:  # copied too: on a CPU .to() would keep a view of an LMDB page reused later
            cache.head_bias = [bias.to(device, copy=True) for bias in head_bias]
        return cache

    def copy_range(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if start >= end:
            return []
        return [(layer.keys[..., start:end, :].clone(), layer.values[..., start:end, :].clone()) for layer in self.layers]

    def prefix_copy(self, num_tokens: int, device: torch.device) -> "KVCache":
        """A new cache of the first `num_tokens` rows, attending as this one would: its bias and a working set
        still waiting for the reply (reply_bias), both cut there (a branch of a conversation, kv_restore.py)."""
        def cut(biases: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
            return None if biases is None else [bias[:, :num_tokens].to(device, copy=True) for bias in biases]

        layers = [(keys[0], values[0]) for keys, values in self.copy_range(0, num_tokens)]  # without the batch axis
        copy = KVCache.from_layers(layers, device, cut(self.head_bias))
        copy.reply_bias = cut(self.reply_bias)
        copy.min_cut = self.min_cut  # the rows it copies hold the same zeros
        return copy

    def append(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Appends saved rows (from copy_range) back, bit for bit."""
        for layer, (keys, values) in zip(self.layers, layers):
            layer.update(keys, values)

    def reserve(self, num_tokens: int, layers_like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (keys, values) in zip(self.layers, layers_like):
            layer.reserve(num_tokens, keys, values)

    def set_length(self, num_tokens: int) -> None:
        """After a pipelined restore filled the reserved rows: every layer now covers `num_tokens`."""
        for layer in self.layers:
            layer._set_length(num_tokens)

    def mark(self) -> list[tuple[torch.Tensor | None, torch.Tensor | None, int]]:
        """What `rollback` needs to put every layer back as it is now, rows and buffers, without a copy."""
        return [(layer._key_buf, layer._value_buf, layer.length) for layer in self.layers]

    def rollback(self, mark: list[tuple[torch.Tensor | None, torch.Tensor | None, int]]) -> None:
        """Every layer as it was at `mark`, whatever a forward since wrote to some of them (one that gave way):
        no row copied back and no buffer shrunk, as a truncate across a capacity boundary would."""
        for layer, (key_buf, value_buf, length) in zip(self.layers, mark):
            layer.put_back(key_buf, value_buf, length)

    def truncate(self, num_tokens: int) -> None:
        """Keeps the first `num_tokens` rows, or none if that is below min_cut (callers read num_tokens)."""
        if num_tokens < self.min_cut:
            num_tokens, self.min_cut = 0, 0
        for layer in self.layers:
            layer.crop(num_tokens)
        if self.head_bias is not None:
            self.head_bias = [bias[:, :num_tokens] for bias in self.head_bias]
        if self.reply_bias is not None:
            self.reply_bias = [bias[:, :num_tokens] for bias in self.reply_bias]
