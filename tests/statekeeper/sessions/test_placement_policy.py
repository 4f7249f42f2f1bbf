"""The placement policy inside the service: the value policy (the default) decides what is compressed and when,
and every turn can be written to a trace the simulator replays (statekeeper/placement/, placement_feed.py)."""

import asyncio
import json
import time

from statekeeper.config import CompressionConfig
from statekeeper.placement.policy import LruPlacement, ValuePolicy
from statekeeper.placement.trace import read
from statekeeper.sessions import TurnRequest

KVZIP_INT4 = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4-rot-g32-s1")
MESSAGES = ["Tell me about the history of Rome, its emperors and its roads. " * 6, "And Carthage?"]


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=8)):
        pass
    return event


def test_the_value_policy_by_default_and_lru_on_request(make_service, tmp_path):
    assert isinstance(make_service(data_dir=tmp_path / "a").tiers.policy, ValuePolicy)
    assert isinstance(make_service(data_dir=tmp_path / "b", placement_policy="lru").tiers.policy, LruPlacement)


def test_the_value_policy_not_the_schedule_decides_when_a_blob_is_compressed(make_service):
    """COMPRESS_AFTER_SECONDS is an hour. Just offloaded, its user is likely back within minutes (the
    heavy-tailed prior: P = 300 / 360), so the blob stays exact; ten minutes on, it is compressed."""
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=3600,
                           compress_quiet_seconds=0, placement_policy="value")
    policy = service.placement_policy

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, MESSAGES[0])
        exact = await service.offload(session)
        await service.compress_due()
        assert service.compactor.counters.compressed == 0 and service.compactor.report()["queued"] == 1
        policy.clock = lambda: time.time() + 600
        await service.compress_due()
        compressed = await service.view(session)
        assert compressed.is_compressed and compressed.stored_bytes < 0.2 * exact.stored_bytes
        assert (await _turn(service, session, MESSAGES[1])).restore_source == "dram"

    asyncio.run(scenario())


def test_a_full_fast_tier_makes_the_value_policy_compress_what_it_would_keep_exact(make_service, tmp_path):
    """The same blob, just offloaded (its user likely back within minutes), in a DRAM tier it fills past 90%:
    kept exact it would be moved down eight times larger, so it is compressed now."""
    probe = make_service(tiers=("dram",), compression=KVZIP_INT4, data_dir=tmp_path / "probe")

    async def blob_bytes():
        session = (await probe.create(None, None)).id
        await _turn(probe, session, MESSAGES[0])
        return (await probe.offload(session)).stored_bytes

    size = asyncio.run(blob_bytes())
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=3600,
                           compress_quiet_seconds=0, placement_policy="value", tier_budget_bytes=int(size / 0.95),
                           data_dir=tmp_path / "service")

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, MESSAGES[0])
        await service.offload(session)
        await service.compress_due()
        view = await service.view(session)
        assert view.is_compressed and view.tier == "dram"

    asyncio.run(scenario())

def test_the_service_writes_its_turns_as_a_trace_without_text(make_service, tmp_path):
    path = tmp_path / "traces" / "day.jsonl"
    service = make_service(trace_file=path)

    async def scenario():
        session = (await service.create(None, None)).id
        results = [await _turn(service, session, message) for message in MESSAGES]
        return session, results, (await service.get_live(session, None)).conversation

    session, results, conversation = asyncio.run(scenario())
    service.close()
    turns = list(read(path))
    assert len(turns) == 2 and turns[0].conversation == turns[1].conversation != session
    assert [turn.reply_tokens for turn in turns] == [result.completion_tokens for result in results]
    assert sum(turn.prompt_tokens + turn.reply_tokens for turn in turns) == len(conversation.tokens)
    assert turns[0].time_s <= turns[1].time_s <= time.time()
    text = path.read_text()
    assert "Rome" not in text and "Carthage" not in text and session not in text
    assert all(set(json.loads(line)) == {"time_s", "conversation", "prompt_tokens", "reply_tokens", "tenant",
                                         "duration_s"} for line in text.splitlines())
    assert all(0 < turn.duration_s < 60 for turn in turns)
