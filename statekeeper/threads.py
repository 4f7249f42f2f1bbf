"""Which threads run torch in parallel. TORCH_THREADS is the model thread's alone; every other thread that
touches torch (the event loop, I/O and restore threads) runs with one.

Why: OpenMP gives each thread that runs a parallel region at more than one thread a team of its own, which
lives as long as that thread. With more OpenMP threads than cores, GNU OpenMP stops spinning between regions,
and each of a decode step's hundreds of small regions waits for a sleeping thread to wake: two teams of two
on two cores made a decode step 2.2x slower (benchmarks/thread_placement.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def use_threads(count: int) -> None:
    """Sets the calling thread's torch thread count (and the count threads born later adopt)."""
    # torch sets a thread's count lazily, at its first parallel op, from the process-wide one, overwriting what
    # set_num_threads gave that thread before; asking for the count first makes that happen now.
    torch.get_num_threads()
    torch.set_num_threads(count)


def on_own_thread(threads: int, fn: Callable[..., T], *args) -> T:
    """Runs fn(*args) at `threads` in a thread that ends with it, so its OpenMP team ends too: for work
    before the model thread starts (loading the weights, measuring the hardware profile)."""
    result: list = []

    def run():
        use_threads(threads)
        try:
            result.append((True, fn(*args)))
        except BaseException as exc:  # re-raised in the caller
            result.append((False, exc))

    thread = threading.Thread(target=run, name="statekeeper-load")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
