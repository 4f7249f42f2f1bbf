"""Exact copies (statekeeper/sessions/exact_copy.py, EXACT_COPY_TIER): a compressed restore takes the exact
state kept one tier down, so it answers as a state never compressed does (or, with COMPRESSION_LIVE_KEEP, as
eviction alone keeping that share); a copy that is missing, corrupt or of an older state costs only itself; it
goes with its conversation."""

import asyncio
import threading

import pytest
import torch

from statekeeper.compression.form import StoredForm
from statekeeper.config import CompressionConfig, ServiceConfig, SessionConfig
from statekeeper.sessions import TurnRequest
from statekeeper.sessions.exact_copy import copy_key
from storage import serialization
from storage.tier_config import TierConfig
from tests.statekeeper.sessions.test_offload import LONG, TURNS

REPLY = [{"role": "user", "content": "Tell me about Rome."},
         {"role": "assistant", "content": "Rome was not built in a day."}]
KVZIP_INT4 = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="int4-rot-g32-s1")
KVZIP_EXACT = CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, codec="none")  # eviction alone
NONE = CompressionConfig(policy="none", codec="none")
# A quarter's rows stored, the half's positions named: with its copy, the turn's prompt attends every row and the
# reply that half (COMPRESSION_LIVE_KEEP)
SMALL = CompressionConfig(policy="heads", scorer="kvzip", keep=0.25, live_keep=0.5, codec="int4-rot-g32-s1")


async def _turn(service, session, content):
    async for event in service.turn(session, TurnRequest(content, max_tokens=12)):
        pass
    return event


def _service(make_service, tmp_path, name, compression=KVZIP_INT4, tiers=("dram", "lmdb"), **options):
    return make_service(tiers=tiers, compression=compression, compress_after_seconds=0,
                        compress_quiet_seconds=0, data_dir=tmp_path / name, **options)


async def _offloaded(service) -> str:
    session = (await service.create(None, None)).id
    await _turn(service, session, LONG)
    await service.offload(session)
    return session


async def _compressed(service) -> str:
    session = await _offloaded(service)
    await service.compress_due()
    assert (await service.view(session)).is_compressed
    return session


def test_a_compressed_restore_with_its_copy_answers_as_the_state_never_compressed(make_service, tmp_path):
    with_copy = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb")
    exact = _service(make_service, tmp_path, "exact", compression=NONE)
    static = _service(make_service, tmp_path, "static")

    async def scored(service, session):
        """The log-probabilities of a teacher-forced reply on the restored state (the session left as it was)."""
        return [token.logprob for token in (await service.score(session, REPLY)).tokens]

    async def scenario():
        session = await _compressed(with_copy)
        assert with_copy.tiers.locate(copy_key(session)) == "lmdb"
        logprobs = await scored(with_copy, session)
        assert logprobs == await scored(exact, await _offloaded(exact))  # the exact state: the same numbers
        static_session = await _compressed(static)
        assert await scored(static, static_session) != logprobs  # evicted entries and the codec's rows
        copies = with_copy.stats()["compression"]["exact_copies"]
        assert (copies["kept"], copies["restores"], copies["missing"], copies["rejected"]) == (1, 1, 0, 0)
        assert static.stats()["compression"]["exact_copies"]["kept"] == 0  # none kept without the setting
        assert static.tiers.locate(copy_key(static_session)) is None
        turn = await _turn(with_copy, await _compressed(with_copy), TURNS[1])  # the turn's restore report says so
        assert (turn.restore_source, turn.restore_exact_copy) == ("dram", "lmdb")
        assert (await _turn(static, await _compressed(static), TURNS[1])).restore_exact_copy is None

    asyncio.run(scenario())


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_copy_restores_as_without_one(make_service, tmp_path, damage):
    with_copy = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb")
    static = _service(make_service, tmp_path, "static")

    async def scenario():
        session, reference = await _compressed(with_copy), await _compressed(static)
        key = copy_key(session)
        if damage == "missing":
            with_copy.tiers.delete(key)
        else:
            copy = bytearray(with_copy.tiers.read_bytes(key))
            copy[len(copy) // 2] ^= 0xFF  # a flipped byte in the payload: its checksum fails
            with_copy.tiers.put(key, bytes(copy), "lmdb")
        scored = await with_copy.score(session, REPLY)
        reference_scored = await static.score(reference, REPLY)
        assert [t.logprob for t in scored.tokens] == [t.logprob for t in reference_scored.tokens]
        copies = with_copy.stats()["compression"]["exact_copies"]
        assert (copies["restores"], copies[damage if damage == "missing" else "rejected"]) == (0, 1)
        assert with_copy.tiers.locate(key) is None

    asyncio.run(scenario())


def test_the_copy_goes_with_a_newer_state_and_with_its_conversation(make_service, tmp_path):
    service = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb")

    async def scenario():
        session = await _compressed(service)
        await _turn(service, session, TURNS[1])
        await service.offload(session)  # a newer exact state: the copy of the older one is stale
        assert service.tiers.locate(copy_key(session)) is None
        await service.compress_due()
        assert service.tiers.locate(copy_key(session)) == "lmdb"
        await service.delete(session)
        assert service.tiers.keys() == set()

    asyncio.run(scenario())


@pytest.mark.parametrize("tier, codecs, message", [("dram", {}, "below the fastest"), ("ssd", {}, "below the fastest"),
                                                    ("lmdb", {"lmdb": "int8"}, "re-encodes")])
def test_the_copy_tier_is_checked_with_the_tiers(tmp_path, tier, codecs, message):
    tiers = [TierConfig(name, 1 << 20, tmp_path / name, codec=codecs.get(name, "none")) for name in ("dram", "lmdb")]
    with pytest.raises(ValueError, match=message):
        ServiceConfig(data_dir=tmp_path, sessions=SessionConfig(exact_copy_tier=tier), tiers=tiers)


def test_a_compressed_blob_and_its_copy_in_one_tier_restore_together(make_service, tmp_path):
    """Demoted to the copy's tier, the compressed blob is read while its copy is read from the same LMDB."""
    with_copy = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb")
    exact = _service(make_service, tmp_path, "exact", compression=NONE)

    async def scenario():
        session = await _compressed(with_copy)
        assert with_copy.tiers.move(session, "lmdb") == "lmdb"
        scored = await with_copy.score(session, REPLY)
        reference = await exact.score(await _offloaded(exact), REPLY)
        assert [t.logprob for t in scored.tokens] == [t.logprob for t in reference.tokens]
        assert with_copy.stats()["compression"]["exact_copies"]["restores"] == 1

    asyncio.run(scenario())


def test_a_small_fast_copy_with_wider_live_positions_restores_half_exact_and_alone_its_own_rows(make_service,
                                                                                                tmp_path):
    """keep 0.25 with live_keep 0.5: the blob stores a quarter's rows and the half's positions. With its copy
    the turn's prompt attends every row and the reply the half, exact; without it, the quarter, as a plain blob
    keeping a quarter does."""
    quarter = CompressionConfig(policy="heads", scorer="kvzip", keep=0.25, codec="int4-rot-g32-s1")
    with_copy = _service(make_service, tmp_path, "copy", compression=SMALL, exact_copy_tier="lmdb")
    half_exact = _service(make_service, tmp_path, "half", compression=KVZIP_EXACT)
    exact = _service(make_service, tmp_path, "exact", compression=NONE)
    plain_quarter = _service(make_service, tmp_path, "quarter", compression=quarter)
    plain_half = _service(make_service, tmp_path, "plain", compression=KVZIP_INT4)

    async def logprobs(service, session=None):
        session = session or await _compressed(service)
        return session, [t.logprob for t in (await service.score(session, REPLY)).tokens]

    async def scenario():
        session, restored = await logprobs(with_copy)
        whole, half = (await logprobs(exact, await _offloaded(exact)))[1], (await logprobs(half_exact))[1]
        assert restored[0] == whole[0] != half[0]  # the reply's first token: predicted by the prompt, on every row
        assert restored[1:] != whole[1:] and restored[1:] != half[1:]  # the rest attend the half
        assert (await logprobs(with_copy, session))[1] == restored  # the session left as it was
        sizes = {}
        for name, service in (("quarter", plain_quarter), ("half", plain_half), ("small", with_copy)):
            sizes[name] = (await service.view(await _compressed(service))).stored_bytes
        assert sizes["quarter"] < sizes["small"] < sizes["half"]  # a quarter's rows, and the half's positions
        small_session = await _compressed(with_copy)
        with_copy.tiers.delete(copy_key(small_session))
        _, alone = await logprobs(with_copy, small_session)
        assert alone == (await logprobs(plain_quarter))[1]

    asyncio.run(scenario())


def test_a_tenants_stored_bytes_count_its_exact_copies(make_service, tmp_path):
    """A copy is the tenant's stored state too: its bytes count against STORED_BYTES limits and in the usage."""
    service = _service(make_service, tmp_path, "tenant", exact_copy_tier="lmdb")

    async def scenario():
        session = await _compressed(service)
        blob, copy = service.tiers.stored_bytes(session), service.tiers.stored_bytes(copy_key(session))
        assert blob and copy and copy > blob  # the exact state beside its compressed form
        (usage,) = service.tenants.usage()  # the default tenant's
        assert usage["stored_bytes"] == blob + copy

    asyncio.run(scenario())


def test_a_copy_of_a_state_restored_without_its_copy_keeps_what_that_state_evicted(make_service, tmp_path):
    """A compressed restore without a copy attends the kept entries only; the next offload's exact blob (and so
    the next copy) carries that bias, and a restore from that copy attends what the state before it did."""
    service = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb")

    async def scenario():
        session = await _compressed(service)
        service.tiers.delete(copy_key(session))
        await _turn(service, session, TURNS[1])  # restored from the compressed blob alone: evicted entries
        before = [t.logprob for t in (await service.score(session, REPLY)).tokens]
        await service.offload(session)
        await service.compress_due()
        assert service.tiers.locate(copy_key(session)) == "lmdb"
        after = [t.logprob for t in (await service.score(session, REPLY)).tokens]
        assert service.stats()["compression"]["exact_copies"]["restores"] == 1
        assert after == before

    asyncio.run(scenario())


@pytest.mark.parametrize("compression", [
    CompressionConfig(policy="heads", scorer="kvzip", keep=0.5, merge=True, codec="int4-rot-g32-s1"),  # merged rows
    CompressionConfig(policy="krul", codec="int4-rot-g32-s1"),  # layers that share
    CompressionConfig(policy="none", codec="int8"),  # the codec alone
])
def test_any_compression_with_its_copy_answers_as_the_state_never_compressed(make_service, tmp_path, compression):
    with_copy = _service(make_service, tmp_path, "copy", compression=compression, exact_copy_tier="lmdb")
    exact = _service(make_service, tmp_path, "exact", compression=NONE)

    async def scenario():
        session = await _compressed(with_copy)
        scored = await with_copy.score(session, REPLY)
        reference = await exact.score(await _offloaded(exact), REPLY)
        assert [t.logprob for t in scored.tokens] == [t.logprob for t in reference.tokens]
        assert with_copy.stats()["compression"]["exact_copies"]["restores"] == 1

    asyncio.run(scenario())


async def _scored(service, session) -> list[float]:
    return [token.logprob for token in (await service.score(session, REPLY)).tokens]


def _stored_form(service, key: str) -> StoredForm:
    with service.tiers.read(key) as (_, blob):
        return StoredForm.from_meta(serialization.read_header(blob)[0].meta)


def test_a_turn_that_does_not_finish_leaves_the_working_set_to_the_next_reply(make_service, tmp_path):
    """The first step of a turn restored from its copy makes the reply attend the working set; a turn whose
    client goes away is rolled back, its bias too, so the next one answers as it would have."""
    service = _service(make_service, tmp_path, "copy", compression=SMALL, exact_copy_tier="lmdb")

    async def scenario():
        session = await _compressed(service)
        before = await _scored(service, session)
        events = service.turn(session, TurnRequest(TURNS[1], max_tokens=12))
        await anext(events)  # the prompt is in, the reply has begun
        await events.aclose()  # the client goes away
        assert await _scored(service, session) == before

    asyncio.run(scenario())


def test_the_working_set_is_the_restored_replys_and_the_next_state_is_stored_exact(make_service, tmp_path):
    """After that reply every row is exact in memory and attended again: the next prompt reads them all, the
    state is stored without the working set's bias, and its next compression chooses among all its entries."""
    service = _service(make_service, tmp_path, "copy", compression=SMALL, exact_copy_tier="lmdb")

    async def scenario():
        session = await _compressed(service)
        await _turn(service, session, TURNS[1])
        in_memory = await _scored(service, session)
        await service.offload(session)
        assert not _stored_form(service, session).bias
        assert await _scored(service, session) == in_memory

    asyncio.run(scenario())


def test_a_copy_that_a_tier_re_encoded_is_not_taken_as_exact(make_service, tmp_path):
    """A copy moved into a tier with a codec (demoted, or put below a full copy tier) holds that codec's rows:
    the compressed blob restores as without a copy, and the copy is dropped."""
    options = dict(tiers=("dram", "lmdb", "ssd"), tier_codecs={"ssd": "int8"})
    with_copy = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb", **options)
    static = _service(make_service, tmp_path, "static", **options)

    async def scenario():
        session = await _compressed(with_copy)
        assert with_copy.tiers.move(copy_key(session), "ssd") == "ssd"
        assert await _scored(with_copy, session) == await _scored(static, await _compressed(static))
        copies = with_copy.stats()["compression"]["exact_copies"]
        assert (copies["restores"], copies["rejected"]) == (0, 1)
        assert with_copy.tiers.locate(copy_key(session)) is None

    asyncio.run(scenario())


def test_a_conversation_deleted_while_its_blob_is_compressed_leaves_no_copy(make_service, tmp_path):
    service = _service(make_service, tmp_path, "copy", exact_copy_tier="lmdb", compress_process=True)

    async def scenario():
        session = await _offloaded(service)
        process = service.compactor.process
        compress = process.compress

        async def deleted_meanwhile(*args, **kwargs):  # the delete lands while the compression process works
            result = await compress(*args, **kwargs)
            await service.delete(session)
            return result

        process.compress = deleted_meanwhile
        await service.compress_due()
        assert service.tiers.keys() == set()

    asyncio.run(scenario())


@pytest.mark.parametrize("shape", ["one head's", "flat"])
def test_a_copy_whose_bias_does_not_fit_its_layers_is_rejected(make_service, tmp_path, shape):
    """A forged copy with an attention bias of the wrong shape beside a blob's working set: dropped, and the
    compressed blob restores as without a copy (not a 500, nor one head's bias broadcast to every head)."""
    with_copy = _service(make_service, tmp_path, "copy", compression=SMALL, exact_copy_tier="lmdb")
    static = _service(make_service, tmp_path, "static", compression=SMALL)

    async def scenario():
        session = await _compressed(with_copy)
        key = copy_key(session)
        with with_copy.tiers.read(key) as (_, blob):
            header, tensors = serialization.decode_any(bytes(blob))
        bias = torch.zeros(1, header.num_tokens) if shape == "one head's" else torch.zeros(header.num_tokens)
        layers = sum(name.endswith(".k") for name in tensors)
        forged = [(name, tensor.clone()) for name, tensor in tensors.items()]
        forged += [(f"{layer}.bias", bias.clone()) for layer in range(layers)]
        with_copy.tiers.put(key, bytes(serialization.reencode_tensors(header, forged, StoredForm(bias=True).to_meta())),
                            "lmdb")
        assert await _scored(with_copy, session) == await _scored(static, await _compressed(static))
        copies = with_copy.stats()["compression"]["exact_copies"]
        assert (copies["restores"], copies["rejected"]) == (0, 1)

    asyncio.run(scenario())


def test_a_restored_attention_bias_is_the_caches_own_not_a_view_of_the_tiers_memory(make_service, tmp_path):
    """A state stored exact with an attention bias (it was restored from a compressed blob without a copy)
    and restored from LMDB: the cache's bias stays what it was when the blob's pages are reused (on a CPU,
    .to(device) is no copy, and LMDB's pages outlive the read only until another write takes them)."""
    service = _service(make_service, tmp_path, "lmdb", tiers=("lmdb",))

    async def scenario():
        session = await _compressed(service)
        await _turn(service, session, TURNS[1])  # restored from the compressed blob alone: evicted entries
        await service.offload(session)
        assert _stored_form(service, session).bias
        before = await _scored(service, session)  # restored from LMDB: bias and rows
        size = service.tiers.stored_bytes(session)
        service.tiers.delete(session)
        for index in range(8):  # other conversations' blobs take the freed pages
            service.tiers.put(f"other{index}", b"\xff" * size)
        assert await _scored(service, session) == before

    asyncio.run(scenario())


def test_a_bad_copy_is_deleted_once_the_blobs_read_is_closed(make_service, tmp_path, monkeypatch):
    """Deleting it inside the compressed blob's LMDB read waited for the writers' lock, whose holder (a put
    growing LMDB's map) waited for every read to end: the service's storage hung for good."""
    service = _service(make_service, tmp_path, "grow", exact_copy_tier="lmdb")
    delete, deadlocked = service.tiers.delete, []

    def delete_beside_a_growing_put(key):
        grower = threading.Thread(target=service.tiers.put, args=("big", bytes(80 << 20), "lmdb"), daemon=True)
        grower.start()
        grower.join(0.5)  # it holds the writers' lock and waits for the reads to end to grow the map
        deleter = threading.Thread(target=delete, args=(key,), daemon=True)
        deleter.start()
        deleter.join(10)
        if deleter.is_alive():  # gives up here, so that the read ends and the test does not hang
            deadlocked.append(key)

    async def scenario():
        session = await _compressed(service)
        assert service.tiers.move(session, "lmdb") == "lmdb"
        copy = bytearray(service.tiers.read_bytes(copy_key(session)))
        copy[len(copy) // 2] ^= 0xFF
        service.tiers.put(copy_key(session), bytes(copy), "lmdb")
        monkeypatch.setattr(service.tiers, "delete", delete_beside_a_growing_put)
        await service.score(session, REPLY)
        assert not deadlocked
        assert service.stats()["compression"]["exact_copies"]["rejected"] == 1

    asyncio.run(scenario())
