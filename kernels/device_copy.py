"""Host-to-device copies of KV rows without a host wait: one 2D copy per (layer, K or V) on a given CUDA
stream (cupy's `memcpy2DAsync`), beside the torch reference it must equal (`copy_rows_reference`).

A stored layer is [heads, tokens, dim] and a cache layer's buffer [heads, capacity, dim]: rows [r, n) of
every head are `heads` equal runs of bytes at one pitch in the source and another in the destination,
which is what a 2D copy moves in a single call. torch's own `copy_` from a strided pinned view first
makes a pageable contiguous copy on the host and then copies synchronously, so without cupy the copy is
issued per head (each head's rows are contiguous on both sides), which costs a launch per head."""

from __future__ import annotations

import torch

try:  # the `cuda` extra; without it the per-head path below is used
    from cupy.cuda import runtime as _cuda_runtime
except Exception:  # ImportError, or a cupy built for another CUDA that fails to load
    _cuda_runtime = None

_HOST_TO_DEVICE = 1  # cudaMemcpyHostToDevice


def _rows_layout(tensor: torch.Tensor) -> tuple[int, int]:
    """(pitch in bytes between heads, bytes of one head's rows) of a [heads, n, dim] view whose rows are
    contiguous within each head; ValueError otherwise."""
    heads, rows, dim = tensor.shape
    if tensor.stride(2) != 1 or (rows > 1 and tensor.stride(1) != dim):
        raise ValueError("each head's rows must be contiguous")
    return tensor.stride(0) * tensor.element_size(), rows * dim * tensor.element_size()


def copy_rows(destination: torch.Tensor, source: torch.Tensor, stream: torch.cuda.Stream | None,
              per_head: bool = False) -> int:
    """Copies a [heads, n, dim] view of pinned host memory into a same-shaped view of device memory, queued
    on `stream` (the host does not wait); returns the number of copy calls issued. Without a stream (a CPU
    destination) it is a plain copy. The source must stay alive and unchanged until the stream has run the
    copy (cupy's copy is not known to torch's pinned allocator: the caller keeps the source referenced until
    an event recorded after it has passed). `per_head` forces torch's per-head copies (the fallback)."""
    if destination.shape != source.shape or destination.dtype != source.dtype:
        raise ValueError(f"copy of {tuple(source.shape)} {source.dtype} into {tuple(destination.shape)} "
                         f"{destination.dtype}")
    if stream is None:
        destination.copy_(source)
        return 1
    if not source.numel():
        return 0
    if not source.is_pinned():
        raise ValueError("an asynchronous copy needs a pinned source (staged through the pinned ring)")
    source_pitch, width = _rows_layout(source)
    destination_pitch, _ = _rows_layout(destination)
    if _cuda_runtime is not None and not per_head:
        _cuda_runtime.memcpy2DAsync(destination.data_ptr(), destination_pitch, source.data_ptr(), source_pitch,
                                    width, source.shape[0], _HOST_TO_DEVICE, stream.cuda_stream)
        return 1
    with torch.cuda.stream(stream):
        for head in range(source.shape[0]):
            destination[head].copy_(source[head], non_blocking=True)
    return source.shape[0]


def copy_rows_reference(destination: torch.Tensor, source: torch.Tensor) -> None:
    """What `copy_rows` must leave in `destination`: a plain synchronous copy."""
    destination.copy_(source.to(destination.device))


def pinned_host_buffer(size: int) -> memoryview:
    """`size` bytes of page-locked host memory as a writable memoryview, returned to torch's pinned
    allocator once no view of it is left: a GPU worker's DRAM tier holds its blobs in it (storage/dram.py), so
    a restore's copies read them in place. torch's allocator, not cudaHostAlloc and cudaFreeHost directly:
    cudaFreeHost waits for the whole device, and a tier frees blobs on any thread (even the model thread, where
    a restore drops the last view of a blob that left the tier). Its price: each block is rounded up to a power
    of two, so the tier's pinned memory may reach twice its budget. Whoever copies from it asynchronously keeps
    a view until the copy has run (the allocator cannot see copies from views inside its blocks)."""
    return memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()).cast("B")
