"""Process-level memory tuning for the CPU path.

glibc may serve large allocations with fresh mmap()s and return freed memory to the kernel, so a
restored KV buffer can be first-touch page-faulted on every restore. Raising the mmap threshold to its
maximum and not trimming the heap lets freed KV buffers be reused warm; benchmarks/restore_copy.py
measures the effect (BENCHMARKS.md). The memory stays with the process, which the active-pool and
DRAM budgets bound anyway."""

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
