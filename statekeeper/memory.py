"""Process-level memory tuning for the CPU path.

glibc serves allocations above 128 KiB-32 MiB (its dynamic threshold) with fresh mmap()s and returns
freed ones to the kernel, so every restored KV buffer is first-touch page-faulted: restoring a
1,500-token SmolLM2 state took 28 ms instead of 7 ms on the 2-core machine (BENCHMARKS.md). Raising the
mmap threshold to its maximum and not trimming the heap lets freed KV buffers be reused warm. The
memory stays with the process, which the active-pool and DRAM budgets bound anyway."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory_warm() -> bool:
    """Returns True when the allocator was tuned (glibc on Linux), False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the KV-friendly settings; restores will page-fault fresh buffers")
    return ok
