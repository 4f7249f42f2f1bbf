"""Sessions whose stored KV is compressed (cross-layer sharing) still restore and answer."""

import asyncio

import pytest
import torch

from statekeeper.sessions import InvalidRequest, TurnRequest

LONG = "Tell me everything you know about the history of the Roman Empire and its emperors. " * 12
TURNS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?"]


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=10)):
        pass
    return event


@pytest.fixture(params=["auto", "bfloat16"])
def kv_worker(request, tiny_model_dir, tiny_worker):
    """The tiny worker, and one that keeps its KV cache in bfloat16 (WorkerConfig.kv_dtype)."""
    if request.param == "auto":
        return tiny_worker
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    config = WorkerConfig(model=str(tiny_model_dir), model_cache_dir=tiny_worker.config.model_cache_dir,
                          prefill_chunk_tokens=64, kv_dtype=request.param)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)


@pytest.fixture
def make_service(make_service):
    """Stored blobs are due for compression at once here; `_offload` runs it."""
    def make(**options):
        options.setdefault("compress_after_seconds", 0.0)
        options.setdefault("compress_quiet_seconds", 0.0)
        return make_service(**options)
    return make


async def _offload(service, session):
    """Goes inactive (the exact state is stored), then the deferred compression runs."""
    await service.offload(session)
    await service.compress_due()
    return await service.view(session)


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
            assert service.in_memory(compressed).stats.distance_rows > 0
        small, full = await _offload(service, compressed), await _offload(service, plain)
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
        await _offload(service, a)
        restored, hot = await _turn(service, a, TURNS[2]), await _turn(service, b, TURNS[2])
        assert restored.content == hot.content
        for (k1, v1), (k2, v2) in zip(service.in_memory(a).cache.export_layers(), service.in_memory(b).cache.export_layers()):
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
        live = await service.get_live(session)
        live.cache = service.worker.new_cache()  # as if restored, but no statistics were gathered
        service.worker.prefill(live.cache, live.conversation.tokens)
        view = await _offload(service, session)
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
        live = service.in_memory(session)
        layers = live.cache.export_layers()
        blob = serialization.encode(layers, service.worker.fingerprint, live.conversation.tokens,
                                    meta={"pairs": [[0, 1]], "parts": [1]})  # names tensors that are absent
        await _offload(service, session)
        service.tiers.put(session, blob)
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "recompute"
        assert service.tiers.stats()[0]["errors"] == 1

    asyncio.run(scenario())


@pytest.mark.parametrize(("options", "max_fraction"), [
    # The tiny model's vectors have 16 fp32 elements (64 bytes): int8 stores 16 codes + fp16 scale and
    # zero (20 bytes, 0.31), int4 8 + 4 (0.19); sharing half the layers' K and V on top of int8, 0.27.
    ({"codec": "int8"}, 0.33),
    ({"codec": "int4", "group_size": 32}, 0.2),
    ({"codec": "int4-rot", "group_size": 32}, 0.2),  # rotated rows: the same bytes as int4
    ({"policy": "minicache", "ratio": 0.5, "share_keys": True, "retain_angle": 1.0, "codec": "int8"}, 0.3),
])
def test_quantized_session_stores_fewer_bytes_and_answers_after_restore(make_service, options, max_fraction):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        quantized = (await service.create(None, None, options)).id
        plain = (await service.create(None, None)).id
        for content in [LONG, TURNS[1]]:  # long enough that the blob's header is a small part of it
            await _turn(service, quantized, content)
            await _turn(service, plain, content)
        small, full = await _offload(service, quantized), await _offload(service, plain)
        # The blob's own codec name, with its group size (int4 with group_size 32 is "int4-g32").
        assert small.codec.startswith(options["codec"]) and small.is_compressed and full.codec == "none"
        assert small.stored_bytes < max_fraction * full.stored_bytes
        hot_layers = service.worker.new_cache()
        service.worker.prefill(hot_layers, service.in_memory(plain).conversation.tokens)
        result = await _turn(service, quantized, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10
        # The restored state is the dequantized one: close to the full KV, not equal, never garbage.
        restored = service.in_memory(quantized).cache.export_layers()
        (k_hot, _), (k_restored, _) = hot_layers.export_layers()[0], restored[0]
        n = k_hot.shape[1]
        assert not torch.equal(k_hot, k_restored[:, :n])
        relative_error = ((k_restored[:, :n] - k_hot).norm() / k_hot.norm()).item()
        assert relative_error < (0.15 if options["codec"].startswith("int4") else 0.01)

    asyncio.run(scenario())


def test_unknown_codec_is_refused(make_service):
    service = make_service(tiers=("lmdb",))
    with pytest.raises(InvalidRequest, match="codec"):
        asyncio.run(service.create(None, None, {"codec": "int3"}))


def test_per_head_budgets_restore_answer_and_compress_again_without_reviving_evicted_tokens(make_service, kv_worker):
    service = make_service(tiers=("lmdb",), worker=kv_worker)
    exact_bytes = kv_worker.kv_dtype.itemsize / 4  # the bounds below are against a float32 state

    async def scenario():
        options = {"policy": "heads", "keep": 0.5, "merge": True, "codec": "int8"}
        evicted = (await service.create(None, None, options)).id
        plain = (await service.create(None, None)).id
        for content in [LONG, TURNS[1]]:
            await _turn(service, evicted, content)
            await _turn(service, plain, content)
        small, full = await _offload(service, evicted), await _offload(service, plain)
        assert small.compression == "heads" and small.stored_bytes < 0.25 / exact_bytes * full.stored_bytes
        result = await _turn(service, evicted, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10
        bias = service.in_memory(evicted).cache.head_bias
        assert bias is not None and all(bool(torch.isinf(b).any()) for b in bias)
        hidden = [~torch.isfinite(b) for b in bias]
        await _offload(service, evicted)
        assert (await _turn(service, evicted, TURNS[0])).restore_source == "lmdb"
        for before, after in zip(hidden, service.in_memory(evicted).cache.head_bias):
            assert (~torch.isfinite(after[:, : before.shape[1]]))[before].all()

    asyncio.run(scenario())


def test_a_biased_state_that_cannot_be_compressed_is_stored_exactly_with_its_bias(make_service):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        # ExpectedAttention scores from the queries the turns gathered (KVzip would score by itself).
        session = (await service.create(None, None, {"policy": "heads", "scorer": "expected", "keep": 0.5})).id
        await _turn(service, session, LONG)
        first = await _offload(service, session)
        assert first.is_compressed
        await _turn(service, session, TURNS[1])
        hidden = [~torch.isfinite(b) for b in service.in_memory(session).cache.head_bias]
        service.in_memory(session).stats = None  # as after a restart: no recent queries to score with
        second = await _offload(service, session)
        assert not second.is_compressed and second.stored_bytes > first.stored_bytes  # exact, kept
        assert service.compactor.counters.skipped == 1
        result = await _turn(service, session, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10
        for before, after in zip(hidden, service.in_memory(session).cache.head_bias):
            assert (~torch.isfinite(after[:, : before.shape[1]]))[before].all()  # evicted stays evicted

    asyncio.run(scenario())


def test_kvzip_scores_are_computed_at_offload_and_the_session_answers_after_restore(make_service):
    service = make_service(tiers=("lmdb",))

    async def scenario():
        session = (await service.create(None, None, {"policy": "heads", "scorer": "kvzip", "keep": 0.4})).id
        await _turn(service, session, LONG)
        view = await _offload(service, session)
        # Stored evicted: the scores were made at offload (the turns gather no statistics for KVzip).
        assert service.placement.stored_form(session).kind == "heads"
        assert view.compression == "heads" and view.stored_bytes is not None
        result = await _turn(service, session, TURNS[1])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10

    asyncio.run(scenario())


def test_tier_codec_quantizes_blobs_landing_in_it_and_the_session_reports_it(make_service):
    service = make_service(tiers=("dram", "lmdb"), tier_codecs={"lmdb": "int4-rot"})

    async def scenario():
        session = (await service.create(None, None)).id
        for content in [LONG, TURNS[1]]:
            await _turn(service, session, content)
        in_dram = await _offload(service, session)
        assert (in_dram.tier, in_dram.codec) == ("dram", "none")
        # Demoted as memory pressure would: the blob lands in lmdb through its codec.
        assert service.tiers.put(session, bytes(service.tiers.tier("dram").get(session)), tier="lmdb") == "lmdb"
        in_lmdb = await service.view(session)
        assert (in_lmdb.tier, in_lmdb.codec) == ("lmdb", "int4-rot")
        assert in_lmdb.stored_bytes < 0.25 * in_dram.stored_bytes
        result = await _turn(service, session, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10

    asyncio.run(scenario())


def test_default_compression_is_kvzip_eviction_with_rotated_int4_and_still_answers(make_service, kv_worker):
    from statekeeper.config import CompressionConfig

    service = make_service(tiers=("lmdb",), compression=CompressionConfig(), worker=kv_worker)  # the default
    exact_bytes = kv_worker.kv_dtype.itemsize / 4  # the bound below is against a float32 state

    async def scenario():
        compressed = (await service.create(None, None)).id
        plain = (await service.create(None, None, {"policy": "none", "codec": "none"})).id
        for content in [LONG, TURNS[1]]:
            await _turn(service, compressed, content)
            await _turn(service, plain, content)
        small, full = await _offload(service, compressed), await _offload(service, plain)
        assert (small.compression, small.codec) == ("heads", "int4-v3-rot-sym-pk8-s1") and full.codec == "none"
        # The tiny model's 16-element rows: int4 keys and 3-bit values in groups of 16 with an fp16 scale,
        # half the entries kept, plus their positions: about a tenth of the fp32 state.
        assert small.stored_bytes < 0.15 / exact_bytes * full.stored_bytes
        result = await _turn(service, compressed, TURNS[2])
        assert result.restore_source == "lmdb" and result.completion_tokens == 10

    asyncio.run(scenario())
