"""Sessions whose stored KV is compressed (cross-layer sharing) still restore and answer."""

import asyncio

import pytest
import torch

from statekeeper.sessions import InvalidRequest, TurnRequest

TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?"]


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


@pytest.mark.parametrize("policy", ["minicache", "krul", "krul_fixed"])
def test_compressed_session_restores_through_a_normal_turn(make_service, policy):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        options = {"policy": policy, "ratio": 0.5, "gamma": 0.0, "share_keys": True, "retain_angle": 1.0}
        compressed = (await service.create(None, None, options)).id
        plain = (await service.create(None, None)).id
        for content in TURNS[:2]:
            await _turn(service, compressed, content)
            await _turn(service, plain, content)
        if policy != "minicache":
            assert service._live[compressed].stats.distance_rows > 0
        small, full = await service.offload(compressed), await service.offload(plain)
        assert small.compression == policy and full.compression == "none"
        assert small.stored_bytes < 0.9 * full.stored_bytes
        result = await _turn(service, compressed, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10
        assert (await _turn(service, plain, TURNS[2])).restore_source == "lmdb"
        assert len(await service.messages(compressed)) == 6

    asyncio.run(scenario())


def test_policy_none_stays_token_identical(make_service):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        a = (await service.create(None, None, {"policy": "none"})).id
        b = (await service.create(None, None)).id
        for content in TURNS[:2]:
            await _turn(service, a, content)
            await _turn(service, b, content)
        await service.offload(a)
        restored, hot = await _turn(service, a, TURNS[2]), await _turn(service, b, TURNS[2])
        assert restored.content == hot.content
        for (k1, v1), (k2, v2) in zip(service._live[a].cache.export_layers(), service._live[b].cache.export_layers()):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    asyncio.run(scenario())


def test_krul_without_statistics_after_a_restart_stores_the_kv_whole(make_service, tmp_path):
    async def first():
        service = make_service(tiers=("lmdb",), data_dir=tmp_path / "d")
        session = (await service.create(None, None, {"policy": "krul", "gamma": 0.0, "ratio": 0.5})).id
        await _turn(service, session, TURNS[0])
        service.close()
        return session

    async def second(session):
        service = make_service(tiers=("lmdb",), data_dir=tmp_path / "d")
        service._live.clear()
        live = await service._get_live(session)
        live.cache = service.worker.new_cache()  # as if restored, but no statistics were gathered
        service.worker.prefill(live.cache, live.conversation.tokens)
        view = await service.offload(session)
        assert view.tier == "lmdb" and view.compression == "krul"
        assert (await _turn(service, session, TURNS[1])).restore_source == "lmdb"

    session = asyncio.run(first())
    asyncio.run(second(session))


def test_bad_compression_options_are_refused(make_service):
    service = make_service()

    async def scenario():
        with pytest.raises(InvalidRequest):
            await service.create(None, None, {"policy": "zip"})
        with pytest.raises(InvalidRequest):
            await service.create(None, None, {"ratio": 3})

    asyncio.run(scenario())


def test_blob_with_valid_checksums_but_unusable_content_recomputes(make_service):
    from storage import serialization

    service = make_service(tiers=("lmdb",))

    async def scenario():
        session = (await service.create(None, None)).id
        await _turn(service, session, TURNS[0])
        live = service._live[session]
        layers = live.cache.export_layers()
        blob = serialization.encode(layers, service.worker.fingerprint, live.conversation.tokens,
                                    meta={"pairs": [[0, 1]], "parts": [1]})  # names tensors that are absent
        await service.offload(session)
        service.tiers.put(session, blob)
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "recompute"
        assert service.tiers.stats()[0]["errors"] == 1

    asyncio.run(scenario())
