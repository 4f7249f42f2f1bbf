"""Which turns gather attention statistics (statekeeper/compression/attention_stats.py): only those whose
compression reads them. Gathering costs every layer of every prefill and decode step."""

import asyncio

import pytest

from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest


async def _statistics_after_a_turn(service, compression: dict | None):
    session = (await service.create(None, None, compression)).id
    async for _ in service.turn(session, TurnRequest("Hello there, how are you?", max_tokens=4)):
        pass
    return (await service.get_live(session)).stats


@pytest.mark.parametrize("compression, gathers", [
    (None, False),  # the default: KVzip scores, computed from the stored KV alone
    ({"policy": "none", "codec": "none"}, False),
    ({"scorer": "kvzip", "merge": True}, True),  # KeepKV merging reads the recent queries
    ({"scorer": "snapkv"}, True),
    ({"scorer": "expected"}, True),
    ({"policy": "krul"}, True),  # layer pairs from the turns' attention maps
])
def test_turns_gather_statistics_only_for_a_compression_that_reads_them(make_service, compression, gathers):
    service = make_service(tiers=("dram",), compression=CompressionConfig())  # the service default
    stats = asyncio.run(_statistics_after_a_turn(service, compression))
    assert (stats is not None) == gathers
