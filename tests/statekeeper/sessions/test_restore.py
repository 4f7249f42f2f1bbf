"""A stored blob back into a turn (statekeeper/sessions/restore.py)."""

import asyncio

import pytest
import torch

from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest
from storage import serialization

LONG = "Tell me everything you know about the history of the Roman Empire and its emperors. " * 12
KVZIP_INT4 = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4-rot-g32-s1")


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


async def _resumed_beside_hot(service) -> tuple[str, object, object]:
    """A conversation offloaded after a long turn and its twin that stayed in memory, each given the same
    next turn: (the offloaded one's id, its turn's result, the twin's)."""
    restored, hot = (await service.create(None, None)).id, (await service.create(None, None)).id
    for session in (restored, hot):
        await _turn(service, session, LONG)
    await service.offload(restored)
    return restored, await _turn(service, restored, "And then?"), await _turn(service, hot, "And then?")


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
        for (k1, v1), (k2, v2) in zip(service.in_memory(layerwise).cache.export_layers(),
                                      service.in_memory(whole).cache.export_layers()):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    asyncio.run(scenario())


async def _compressed_beside_twin(service) -> tuple[str, str, dict]:
    """A conversation stored compressed (in the DRAM tier) and its lossless twin held in memory, the same long
    turn each: (its id, the twin's, the stored blob's tensors, copies to forge)."""
    session, twin = (await service.create(None, None)).id, (await service.create(None, None, {"policy": "none", "codec": "none"})).id
    for name in (session, twin):
        await _turn(service, name, LONG)
    await service.offload(session)
    await service.compress_due()
    _, tensors = serialization.decode_any(bytes(service.tiers.tier("dram").get(session)))
    return session, twin, {name: tensor.clone() for name, tensor in tensors.items()}


def _forge(service, session: str, tensors: dict) -> None:
    """Stores `tensors` as the conversation's blob, well-formed (the header's checksums and digest right)."""
    header, _ = serialization.decode_any(bytes(service.tiers.tier("dram").get(session)))
    service.tiers.put(session, serialization.reencode_tensors(header, list(tensors.items()), header.meta))


@pytest.mark.parametrize("busy", [False, True])  # True: other users' work in hand (the prompt is not the restore's)
@pytest.mark.parametrize("device_restorer", [False, True])  # True: the GPU worker's path, by its CPU reference
def test_a_compressed_blob_whose_layers_do_not_load_is_recomputed_and_discarded(make_service, tiny_worker,
                                                                                  device_restorer, busy, monkeypatch):
    """With the model thread busy, the device restorer's fallback recomputed the history alone and handed back
    its logits, which the turn took for its prompt's: the user's message was never fed, and the KV stayed a
    message short of the tokens for every later turn."""
    from statekeeper.device_restore import DeviceRestorer

    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0)
    if device_restorer:
        service.loader.device_restorer = DeviceRestorer(tiny_worker)

    async def scenario():
        session, twin, tensors = await _compressed_beside_twin(service)
        tensors["3.counts"] = tensors["3.counts"] + 1  # names more rows than the layer stores
        _forge(service, session, tensors)
        if busy:
            monkeypatch.setattr(service.executors.model_thread, "is_idle", lambda: False)
        result, hot = await _turn(service, session, "And then?"), await _turn(service, twin, "And then?")
        assert result.restore_source == "recompute" and result.content == hot.content
        assert service.tiers.locate(session) is None and service.tiers.stats()[0]["errors"] == 1
        again, hot_again = await _turn(service, session, "More?"), await _turn(service, twin, "More?")
        assert (again.content, again.prompt_tokens) == (hot_again.content, hot_again.prompt_tokens)

    asyncio.run(scenario())


@pytest.mark.parametrize("forgery", ["keys one wide", "negative votes", "zero votes", "votes of another length"])
@pytest.mark.parametrize("device_restorer", [False, True])  # True: the GPU worker's path, by its CPU reference
def test_a_well_formed_per_head_blob_whose_rows_do_not_fit_is_recomputed(make_service, tiny_worker, forgery,
                                                                         device_restorer):
    """A blob that decodes (checksums and counts right) but whose keys are one value wide, or whose merge votes
    are not counts of at least one: the layer-by-layer restore broadcast the narrow keys over every dimension,
    and took log(votes) as the attention bias (NaN, -inf): a reply from garbage or from NaN logits, stored
    again with the next state. Recomputed from the history instead, as the whole-blob restore already did."""
    from statekeeper.device_restore import DeviceRestorer

    merging = CompressionConfig(policy="heads", scorer="expected", keep=0.5, budgets="uniform", codec="none",
                                merge=True)
    service = make_service(tiers=("dram",), compression=merging, compress_after_seconds=0, compress_quiet_seconds=0)
    if device_restorer:
        service.loader.device_restorer = DeviceRestorer(tiny_worker)

    async def scenario():
        session, twin, tensors = await _compressed_beside_twin(service)
        assert "0.votes" in tensors  # the merge stored its votes
        if forgery == "keys one wide":
            tensors["0.k"] = tensors["0.k"][:, :1].contiguous()
        elif forgery == "votes of another length":
            tensors["0.votes"] = tensors["0.votes"][1:].contiguous()
        else:
            tensors["0.votes"] = -tensors["0.votes"] if forgery == "negative votes" else tensors["0.votes"] * 0
        _forge(service, session, tensors)
        result, hot = await _turn(service, session, "And then?"), await _turn(service, twin, "And then?")
        assert result.restore_source == "recompute" and result.content == hot.content

    asyncio.run(scenario())


def _header(tiny_worker, tensors=(), meta=None, num_tokens=8):
    from storage.serialization import BlobHeader, TensorEntry

    entries = [TensorEntry(name, dtype, shape, 0, 0) for name, dtype, shape in tensors]
    return BlobHeader(tiny_worker.fingerprint, num_tokens, "0" * 16, entries, meta or {})


def _quant(shape, **info):
    described = {"0.k": {"dtype": "float32", "shape": shape, "bits": 4, "group_size": 32} | info}
    return {"quant": {"codec": "int4", "group_size": 32, "tensors": described}}


def test_headers_that_would_allocate_beyond_the_models_shape_are_refused_before_any_decode(tiny_worker):
    """xxh3 is no defence against a crafted blob: every size a header declares is checked against the
    model's shape (layers, KV heads, head dim) and the blob's token count before anything is allocated."""
    from statekeeper.sessions.restore import check_fits_model
    from storage.serialization import BlobError

    heads, dim, layers = tiny_worker.num_kv_heads, tiny_worker.head_dim, tiny_worker.num_layers
    fits = [("0.k", "float32", [heads, 8, dim]), ("0.counts", "int32", [heads])]
    check_fits_model(_header(tiny_worker, fits, {"heads": True, "num_tokens": 8}), tiny_worker)
    check_fits_model(_header(tiny_worker, meta=_quant([heads, 8, dim], axis="tokens", padded=[heads, 32, dim],
                                                      rotation=1)), tiny_worker)
    crafted = [
        _header(tiny_worker, [("0.counts", "int32", [1_000_000])], {"heads": True, "num_tokens": 8}),
        _header(tiny_worker, [("0.counts", "int32", [heads])], {"heads": True, "num_tokens": 10**9}),
        _header(tiny_worker, [(f"{layers}.k", "float32", [heads, 8, dim])]),
        _header(tiny_worker, [("0.k", "float32", [heads, 10**6, dim])]),
        _header(tiny_worker, meta=_quant([10**6, 10**6, dim])),
        _header(tiny_worker, meta=_quant([heads, 8, 2**20], rotation=1)),
        _header(tiny_worker, meta=_quant([heads, 8, dim], axis="tokens", padded=[heads, 10**9, dim])),
        _header(tiny_worker, meta=_quant("not a shape")),
        _header(tiny_worker, meta={"pairs": [[0, 10**6]], "parts": [1]}),
        # rows left out of a layer that attends to all of them (the tiny llama has no sliding window)
        _header(tiny_worker, meta={"form": 1, "kind": "exact", "window_starts": [4] + [0] * (layers - 1)}),
        _header(tiny_worker, meta={"form": 1, "kind": "exact", "window_starts": [0]}),  # not every layer
    ]
    for header in crafted:
        with pytest.raises(BlobError):
            check_fits_model(header, tiny_worker)


def test_a_crafted_blob_with_valid_checksums_is_recomputed(make_service):
    service = make_service(tiers=("dram",))

    async def scenario():
        session, twin = (await service.create(None, None)).id, (await service.create(None, None)).id
        for s in (session, twin):
            await _turn(service, s, "Hello there")
        await service.offload(session)
        tokens = service.history.load(session).tokens
        worker = service.worker
        counts = torch.zeros(100_000, dtype=torch.int32)  # 100k heads: a [100k, T, d] cache per layer
        tensors = [item for i in range(worker.num_layers) for item in (
            (f"{i}.k", torch.zeros(0, worker.head_dim)), (f"{i}.v", torch.zeros(0, worker.head_dim)),
            (f"{i}.index", torch.zeros(0, dtype=torch.int32)), (f"{i}.counts", counts))]
        crafted = serialization.encode_tensors(tensors, worker.fingerprint, tokens, len(tokens),
                                               {"heads": True, "num_tokens": len(tokens), "method": "kvzip@0.5"})
        service.tiers.put(session, crafted)
        restored, reference = await _turn(service, session, "And then?"), await _turn(service, twin, "And then?")
        assert restored.restore_source == "recompute" and restored.content == reference.content
        assert service.stats()["tiers"][0]["errors"] == 1

    asyncio.run(scenario())


def test_under_load_a_compressed_blob_decodes_off_the_model_thread_and_its_prompt_rides_the_batch(make_service):
    """When the model thread has other work, a compressed restore does not take it for the whole prompt's
    prefill (one job that every decoding user waits behind): the blob decodes on the restore's own thread
    and the prompt goes through the batch a chunk at a time, with the same reply. (One model thread: a long
    lane would take the prompt while the model thread is busy.)"""
    import time

    service = make_service(tiers=("dram",), compression=KVZIP_INT4, compress_after_seconds=0,
                           compress_quiet_seconds=0, long_prefill_lane="off")

    async def scenario():
        restored, reference = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (restored, reference):
            await _turn(service, session, LONG)
            await service.offload(session)
        await service.compress_due()
        idle = await _turn(service, reference, "And then?")  # the model thread idle: restored behind the prefill
        assert idle.restore_layerwise["measured"]["compute_ms"] > 0
        rows_before = service.stats()["model_thread"]["batch_rows"]
        busy = asyncio.ensure_future(service.executors.in_model_thread(time.sleep, 0.3))  # another user's work
        await asyncio.sleep(0.05)
        loaded = await _turn(service, restored, "And then?")
        await busy
        assert loaded.restore_source == "dram" and loaded.restore_layerwise["fallback"] is None
        assert loaded.restore_layerwise["measured"]["compute_ms"] == 0  # no prefill ran with the restore
        prompt_tokens = loaded.prompt_tokens - loaded.cached_tokens
        assert service.stats()["model_thread"]["batch_rows"] - rows_before >= prompt_tokens + loaded.completion_tokens - 1
        assert loaded.content == idle.content and loaded.cached_tokens == idle.cached_tokens

    asyncio.run(scenario())


@pytest.mark.parametrize("compression", [KVZIP_INT4, CompressionConfig(policy="none", codec="none")])
def test_a_restore_through_the_device_restorer_answers_as_the_state_that_stayed(make_service, tiny_worker,
                                                                                 compression):
    """The GPU worker's restore path (statekeeper/device_restore.py), run by its CPU reference: a compressed
    blob answers as its whole restore does, an exact one as the conversation that never left memory."""
    from statekeeper.device_restore import DeviceRestorer

    service = make_service(tiers=("dram",), compression=compression, compress_after_seconds=0,
                           compress_quiet_seconds=0)

    async def scenario():
        restored, reference = (await service.create(None, None)).id, (await service.create(None, None)).id
        for session in (restored, reference):
            await _turn(service, session, LONG)
        await service.offload(restored)
        await service.compress_due()
        if compression.policy != "none":  # the reference: the same blob restored whole before the turn
            await service.offload(reference)
            await service.compress_due()
            await service.score(reference, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi."}])
        service.loader.device_restorer = DeviceRestorer(tiny_worker)  # the reference was restored without it
        result, expected = await _turn(service, restored, "And then?"), await _turn(service, reference, "And then?")
        assert result.restore_source == "dram" and result.content == expected.content
        assert service.in_memory(restored).last_device["compressed"] == (compression.policy != "none")
        for (k1, v1), (k2, v2) in zip(service.in_memory(restored).cache.export_layers(),
                                      service.in_memory(reference).cache.export_layers()):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)

    asyncio.run(scenario())


def test_a_device_restore_recomputes_the_prefix_its_profile_plans_and_answers_as_hot(make_service, tiny_worker):
    """With a device profile whose link is slow against its compute, an exact blob restores with Krul's
    split (a prefix recomputed while the rest copies) and the reply is the one of the conversation that
    never left memory."""
    from scheduler.plan import ComputeProfile, LoadProfile
    from statekeeper.device_profile import DeviceProfile
    from statekeeper.device_restore import DeviceRestorer

    service = make_service(tiers=("dram",), compression=CompressionConfig(policy="none", codec="none"))
    restorer = DeviceRestorer(tiny_worker)
    # loading a token costs twice what recomputing it does: the planner recomputes about two thirds
    per_token_ms = 0.01
    restorer.profile = DeviceProfile("test", LoadProfile(0.0, tiny_worker.kv_bytes_per_token / (2 * per_token_ms) / 1e3),
                                     1e9, ComputeProfile(0.0, per_token_ms, 0.0))
    service.loader.device_restorer = restorer

    async def scenario():
        restored, result, expected = await _resumed_beside_hot(service)
        report = service.in_memory(restored).last_device
        assert result.restore_source == "dram" and 0 < report["recompute_tokens"] < report["tokens"]
        assert result.content == expected.content

    asyncio.run(scenario())


def test_a_restore_too_long_for_the_pinned_ring_is_loaded_the_generic_way_and_kept(make_service, tiny_worker):
    from statekeeper.device_restore import DeviceRestorer, PinnedRing

    service = make_service(tiers=("dram",), compression=CompressionConfig(policy="none", codec="none"))
    restorer = DeviceRestorer(tiny_worker, PinnedRing(64, 2, pinned=False))
    restorer.on_gpu = True  # its ring is what decides here: the staging plan refuses before anything is queued
    service.loader.device_restorer = restorer

    async def scenario():
        restored, result, expected = await _resumed_beside_hot(service)
        assert result.restore_source == "dram" and result.content == expected.content
        assert service.in_memory(restored).last_device is None  # not the device restorer's
        assert service.tiers.stats()[0]["errors"] == 0

    asyncio.run(scenario())
