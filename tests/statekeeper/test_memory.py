"""statekeeper/memory.py: what the allocator reports holding."""

import sys

import pytest
import torch

from statekeeper.memory import heap_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")

MiB = 1 << 20


def test_heap_in_use_follows_what_is_allocated_and_freed():
    before = heap_bytes()
    if before is None:
        pytest.skip("glibc without mallinfo2 (< 2.33)")
    buffers = [torch.ones(MiB // 4) for _ in range(64)]  # 64 one-MiB buffers from the arenas
    held = heap_bytes()
    del buffers
    after = heap_bytes()
    assert held["in_use"] - before["in_use"] >= 64 * MiB
    assert held["in_use"] - after["in_use"] >= 64 * MiB
    assert after["free_held"] >= 0
