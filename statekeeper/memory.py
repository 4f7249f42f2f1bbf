"""Process-level memory tuning for the CPU path.

glibc may serve large allocations with fresh mmap()s and return freed memory to the kernel, so a
restored KV buffer can be first-touch page-faulted on every restore. Raising the mmap threshold to its
maximum and not trimming the heap lets freed KV buffers be reused warm; benchmarks/restore_copy.py
measures the effect (BENCHMARKS.md). While the service is busy the memory stays with the process (the
active-pool and DRAM budgets bound it); once it is quiet, `FreedMemory.give_back` returns what the peak
left free (a few prompts at the context limit leave ~1 GB that glibc keeps even untuned: BENCHMARKS.md,
issue 28), and the next restore pays the first-touch faults of what it allocates again."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MAX_MMAP_THRESHOLD = 32 << 20  # glibc's upper limit on 64-bit
_TRIM_THRESHOLD = 1 << 30


@functools.cache  # the admin stats read the heap on every call: load the library once
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, or not glibc
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory_warm() -> bool:
    """Returns True when the allocator was tuned (glibc on Linux), False elsewhere."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    ok = mallopt(_M_MMAP_THRESHOLD, _MAX_MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    if not ok:
        log.warning("mallopt refused the KV-friendly settings; restores will page-fault fresh buffers")
    return ok



class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes() -> dict | None:
    """What glibc's allocator holds (mallinfo2, glibc >= 2.33): `in_use`, the bytes allocated and not freed
    (arena chunks and mmapped ones), and `free_held`, the bytes freed into its arenas and not handed back to
    the kernel (resident or not). Resident memory that grows while `in_use` does not is the allocator's
    keeping; `in_use` that grows is something still held. None elsewhere."""
    libc = _glibc()
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use": info.uordblks + info.hblkhd, "free_held": info.fordblks}


def resident_bytes() -> int | None:
    """The process's resident memory (VmRSS), or None where /proc does not say."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class FreedMemory:
    """Gives the pages glibc holds freed back to the kernel (malloc_trim(0), which since glibc 2.8 releases
    free pages inside every arena, not only at the top of the heap). Worth a call only when the process has
    grown by `worth_bytes` since the least it held after the last one: memory that is in use does not go, and
    then the next call waits for more growth instead of walking the arenas again for nothing."""

    def __init__(self, worth_bytes: int = 32 << 20):
        self._libc = _glibc()
        self.worth_bytes = worth_bytes
        self._least = resident_bytes() or 0
        self.given_back_bytes = 0  # in all, as resident memory went down across the calls

    def give_back(self) -> bool:
        """Returns the freed pages if the process grew enough since the last time; whether it tried."""
        resident = resident_bytes()
        if self._libc is None or resident is None:
            return False
        self._least = min(self._least, resident)
        if resident - self._least < self.worth_bytes:
            return False
        self._libc.malloc_trim(0)
        after = resident_bytes() or resident
        self.given_back_bytes += max(0, resident - after)
        self._least = after
        return True
