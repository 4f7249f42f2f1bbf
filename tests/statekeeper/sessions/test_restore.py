"""A stored blob back into a turn (statekeeper/sessions/restore.py)."""

import asyncio

import torch

from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest

LONG = "Tell me everything you know about the history of the Roman Empire and its emperors. " * 12
KVZIP_INT4 = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4-rot-g32-s1")


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


def test_a_compressed_blob_restored_behind_the_prompt_prefill_answers_as_a_whole_restore_does(make_service):
    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0)

    async def scenario():
        layerwise, whole = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (layerwise, whole):
            await _turn(service, session, LONG)
            await service.offload(session)
        await service.compress_due()
        assert [(await service.view(s)).is_compressed for s in (layerwise, whole)] == [True, True]
        # Scoring restores the whole blob before anything runs; a turn restores it layer by layer.
        await service.score(whole, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."}])
        restored, reference = await _turn(service, layerwise, "And then?"), await _turn(service, whole, "And then?")
        assert (restored.restore_source, reference.restore_source) == ("dram", "active")
        assert restored.content == reference.content and restored.cached_tokens == reference.cached_tokens
        for (k1, v1), (k2, v2) in zip(service._live[layerwise].cache.export_layers(),
                                      service._live[whole].cache.export_layers()):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    asyncio.run(scenario())


def test_a_compressed_blob_whose_layers_do_not_load_is_recomputed_and_discarded(make_service):
    from storage import serialization

    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0)

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None, {"policy": "none", "codec": "none"})).id
        for name in (session, twin):
            await _turn(service, name, LONG)
        await service.offload(session)
        await service.compress_due()
        header, tensors = serialization.decode_any(bytes(service.tiers.tier("dram").get(session)))
        tensors = dict(tensors)
        tensors["3.counts"] = tensors["3.counts"] + 1  # names more rows than the layer stores
        blob = serialization.reencode_tensors(header, list(tensors.items()), header.meta)
        service.tiers.put(session, blob)
        result, hot = await _turn(service, session, "And then?"), await _turn(service, twin, "And then?")
        assert result.restore_source == "recompute" and result.content == hot.content
        assert service.tiers.locate(session) is None and service.tiers.stats()[0]["errors"] == 1

    asyncio.run(scenario())
