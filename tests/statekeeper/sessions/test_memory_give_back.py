"""A service that has been quiet for GIVE_BACK_MEMORY_AFTER_SECONDS returns the memory its last busy spell
left freed to the kernel (statekeeper/memory.py): glibc keeps it otherwise, tuned or not, and a few prompts at
the context limit left the process ~1 GB larger for good (BENCHMARKS.md, issue 28). While turns run, or
before the quiet time has passed, the memory stays for their KV."""

import asyncio
import sys

import pytest
import torch

from statekeeper.memory import resident_bytes
from statekeeper.sessions import TurnRequest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc")

MiB = 1 << 20
PEAK_MiB = 256


def _peak() -> None:
    """What a peak of long conversations leaves: KV-sized buffers (2 MiB each, under the mmap threshold, so
    they come from glibc's arenas as a layer's KV does), written, then freed."""
    buffers = [torch.ones(MiB // 2) for _ in range(PEAK_MiB // 2)]
    del buffers


def _freed_then_swept(service) -> tuple[int, int]:
    async def scenario():
        session = (await service.create(None, None)).id
        async for _ in service.turn(session, TurnRequest("Hello there", max_tokens=4)):
            pass
        await asyncio.to_thread(_peak)  # on another thread, in its own arena, as the model thread's KV is
        before = resident_bytes()
        await service.sweep()
        return before, resident_bytes()

    return asyncio.run(scenario())


def test_a_quiet_service_gives_back_what_a_peak_left_freed(make_service):
    service = make_service(tiers=("dram",), give_back_memory_after_seconds=0.0)
    before, after = _freed_then_swept(service)
    assert before - after >= PEAK_MiB * MiB * 3 // 4, (before // MiB, after // MiB)
    assert service.stats()["memory"]["freed_given_back_bytes"] >= PEAK_MiB * MiB * 3 // 4


def test_memory_is_kept_until_the_service_has_been_quiet_long_enough(make_service):
    service = make_service(tiers=("dram",), give_back_memory_after_seconds=3600.0)
    before, after = _freed_then_swept(service)
    assert service.stats()["memory"]["freed_given_back_bytes"] == 0
    assert before - after < PEAK_MiB * MiB // 4, (before // MiB, after // MiB)
