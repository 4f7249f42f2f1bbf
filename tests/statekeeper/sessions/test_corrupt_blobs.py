"""A stored blob damaged in any tier (issue 14's fault list): one byte flipped in its header, its middle
or its end, written back through the tier itself. The next turn never answers from it: it recomputes
from the history and says exactly what a session that never left memory says; the damage is counted."""

import asyncio

import pytest

from statekeeper.config import CompressionConfig
from tests.statekeeper.sessions.test_lifecycle import USER_TURNS, turn, twin_sessions


@pytest.mark.parametrize("tier", ["dram", "lmdb", "ssd", "redis"])
@pytest.mark.parametrize("where", [0.01, 0.5, 0.999])
@pytest.mark.parametrize("compression", ["lossless", "default"])
def test_a_damaged_blob_in_any_tier_is_recomputed_never_served(make_service, tier, where, compression):
    options = {} if compression == "lossless" else {"compression": CompressionConfig(), "compress_after_seconds": 0}
    service = make_service(tiers=(tier,), **options)

    async def scenario():
        hot, stored = await twin_sessions(service)
        await service.offload(stored)
        if compression == "default":
            await service.compress_due()
            assert service.placement.stored_form(stored).kind == "heads"  # the compressed blob is the one damaged
        holder = service.tiers.tier(tier)
        blob = bytearray(holder.get(stored))
        blob[int(where * (len(blob) - 1))] ^= 0x5A
        holder.put(stored, blob)
        expected = await turn(service, hot, USER_TURNS[2])  # its KV never left memory: exact
        result = await turn(service, stored, USER_TURNS[2])
        assert result.restore_source == "recompute" and result.cached_tokens == 0
        assert result.content == expected.content
        assert service.tiers.stats()[0]["errors"] == 1
        assert len(await service.messages(stored)) == 6

    asyncio.run(scenario())
