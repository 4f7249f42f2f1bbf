import pytest
import torch

from statekeeper.compression import by_name, from_config
from statekeeper.compression.head_profile import HeadProfile, load_profile, profile_path
from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest


def test_a_profile_round_trips_through_json_and_reads_budgets_by_keep():
    profile = HeadProfile("model-a", "kvzip", 2.0, 3, {"0.5": [[0.4, 0.6]], "0.25": [[0.1, 0.3]]},
                          {"0.5": [[0.3, 0.5]]}, {"0.5": [[0.05, 0.05]]}, {"0.5": 0.9})
    assert HeadProfile.from_json(profile.to_json()) == profile
    assert profile.budget_for(0.5) == [[0.4, 0.6]] and profile.budget_for(0.25) == [[0.1, 0.3]]
    assert profile.budget_for(0.3) is None


def test_profiles_load_only_for_their_model_and_scorer_and_fall_back_to_uniform(tmp_path):
    profile = HeadProfile("model-a", "kvzip", 2.0, 1, {"0.5": [[0.4, 0.6]]}, {}, {}, {})
    profile_path(tmp_path, "model-a", "kvzip").write_text(profile.to_json())
    profile_path(tmp_path, "model-b", "kvzip").write_text("{not json")
    shape = (1, 2)  # one layer of two KV heads
    assert load_profile(tmp_path, "model-a", "kvzip", shape) == profile
    assert load_profile(tmp_path, "model-b", "kvzip", shape) is None
    assert load_profile(tmp_path, "model-a", "expected", shape) is None
    config = CompressionConfig(policy="heads", budgets="calibrated", scorer="kvzip", keep=0.5, codec="none")
    assert from_config(config, profile).profile == [[0.4, 0.6]]
    assert from_config(config, None).budgets == "uniform"
    assert from_config(CompressionConfig(policy="heads", budgets="calibrated", keep=0.3, codec="none"),
                       profile).budgets == "uniform"


def test_the_service_reports_missing_calibration_and_uses_a_profile_once_written(make_service, tmp_path):
    import asyncio

    config = CompressionConfig(policy="heads", budgets="calibrated", scorer="expected", keep=0.5)
    service = make_service(tiers=("lmdb",), compression=config, compress_after_seconds=0, compress_quiet_seconds=0)
    profile_dir = tmp_path / "profiles"  # the service's data directory's
    assert "uniform budgets" in asyncio.run(service.readouts.health())["notes"][0]
    heads, layers = service.worker.num_kv_heads, service.worker.num_layers
    budgets = [[1.0] + [0.1] * (heads - 1)] * layers
    profile = HeadProfile(service.worker.fingerprint, "expected", 2.0, 1, {"0.5": budgets}, {}, {}, {})
    profile_dir.mkdir()
    profile_path(profile_dir, service.worker.fingerprint, "expected").write_text(profile.to_json())
    assert not [note for note in asyncio.run(service.readouts.health())["notes"] if "budgets" in note]

    async def scenario():
        session = (await service.create(None, None)).id
        async for _ in service.turn(session, TurnRequest("Hello " * 80, max_tokens=4)):
            pass
        await service.offload(session)
        await service.compress_due()  # the stored exact state is compressed (with the profile's budgets)
        async for event in service.turn(session, TurnRequest("And?", max_tokens=4)):
            pass
        bias = service.in_memory(session).cache.head_bias[0]
        assert bool(torch.isfinite(bias[0]).all()) and float(torch.isfinite(bias[1]).float().mean()) < 0.5

    asyncio.run(scenario())


def test_a_profile_whose_tables_are_not_the_models_heads_is_ignored(make_service):
    """A profile for this model's fingerprint whose budgets had a head or a layer too few (a file edited by hand,
    or written by a calibration of another build) was taken: the heads it lacked kept their sinks and recent
    tokens only, or every compression failed."""
    import asyncio

    config = CompressionConfig(policy="heads", budgets="calibrated", scorer="expected", keep=0.5)
    service = make_service(tiers=("lmdb",), compression=config)
    heads, layers = service.worker.num_kv_heads, service.worker.num_layers
    path = profile_path(service.compression.profile_dir, service.worker.fingerprint, "expected")
    path.parent.mkdir(parents=True, exist_ok=True)
    for budgets in ([[0.5] * (heads - 1)] * layers, [[0.5] * heads] * (layers - 1), [["0.5"] * heads] * layers,
                    [[1.5] * heads] * layers):
        path.write_text(HeadProfile(service.worker.fingerprint, "expected", 2.0, 1, {"0.5": budgets}, {}, {},
                                    {}).to_json())
        assert "uniform budgets" in asyncio.run(service.readouts.health())["notes"][0], budgets
    taxonomy = {"roles": [["pivot"] * heads] * layers, "live_budgets": [[1.0] * heads] * layers,
                "stability": [[0.5] * heads] * layers, "pair_overlap": [[[0.5] * heads] * heads] * layers,
                "clusters": [{"layer": 0, "pivot": heads, "satellites": []}]}  # a head this model does not have
    with pytest.raises(ValueError, match="cluster"):
        HeadProfile("m", "expected", 2.0, 1, {"0.5": [[0.5] * heads] * layers}, {}, {}, {}, taxonomy).check(layers,
                                                                                                           heads)


def test_calibrated_method_names_need_a_matching_profile():
    profile = HeadProfile("m", "kvzip", 2.0, 1, {"0.5": [[0.4, 0.6]]}, {}, {}, {})
    method = by_name("kvzip-calibrated@0.5+int4", profile=profile)
    assert method.inner.budgets == "calibrated" and method.inner.profile == [[0.4, 0.6]]
    for name, given in (("kvzip-calibrated@0.3", profile), ("expected-calibrated@0.5", profile),
                        ("kvzip-calibrated@0.5", None)):
        with pytest.raises(ValueError, match="calibrated"):
            by_name(name, profile=given)
