"""A conversation, a new message and compressed blobs of it, shared by the restore tests (CPU and GPU)."""

from statekeeper.compression import StoredForm

TOKENS = list(range(5, 205))
MESSAGE = list(range(300, 390))  # two of the tiny worker's 64-token prefill chunks


def compressed(worker, method: str, tokens=TOKENS, message=MESSAGE):
    """(tensors, form) of `tokens`' state compressed by `method`, as a restore reads them from a blob."""
    from statekeeper.compression import by_name
    from storage import serialization

    cache, stats = worker.new_cache(), worker.new_stats()
    worker.prefill(cache, tokens, stats)
    state = by_name(method).compress(cache.export_layers(), stats)
    blob = serialization.encode_tensors(state.tensors, worker.fingerprint, tokens, len(tokens), state.meta)
    header, tensors = serialization.decode_tensors(blob, worker.fingerprint, tokens + message)
    return tensors, StoredForm.from_meta(header.meta)


def sequential(worker, tensors, form, message=MESSAGE):
    """The reference: restore_state, a cache from its layers and bias, then the message's prefill."""
    from statekeeper.compression import restore_state
    from statekeeper.kv_cache import KVCache

    layers, bias = restore_state(tensors, form, worker.num_layers)
    cache = KVCache.from_layers(layers, worker.device, bias)
    return cache, worker.prefill(cache, message)
