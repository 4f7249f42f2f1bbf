import math

import pytest
import torch

from statekeeper.calibration import HeadProfile, calibrate_heads, load_profile, profile_path, retention_ratios
from statekeeper.compression import from_config
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.config import CompressionConfig
from statekeeper.sessions import TurnRequest


def test_retention_ratios_follow_the_layer_wide_competition():
    torch.manual_seed(0)
    focused = torch.zeros(100)
    focused[:10] = 1.0
    scores = [torch.stack([focused + 0.01 * torch.rand(100), torch.rand(100) + 0.5])]  # head 1 wants more
    ratios = retention_ratios(scores, rho=0.5, sink_tokens=0, recent_tokens=0)
    assert ratios.shape == (1, 2) and float(ratios.sum()) == pytest.approx(1.0)  # 0.5 * 2 heads
    assert ratios[0, 1] > ratios[0, 0]


@pytest.mark.parametrize("scorer", ["expected", "kvzip"])
def test_calibrate_heads_writes_budgets_mean_plus_alpha_sigma(tiny_worker, scorer):
    torch.manual_seed(0)
    histories = [torch.randint(5, 200, (n,)).tolist() for n in (80, 100, 120)]
    profile = calibrate_heads(tiny_worker, histories, [0.3, 0.5], scorer, alpha=2.0, log=lambda line: None)
    assert profile.samples == 3 and set(profile.budgets) == {"0.3", "0.5"}
    mean, std, budget = (torch.tensor(x["0.5"]) for x in (profile.means, profile.stds, profile.budgets))
    assert budget.shape == (tiny_worker.num_layers, tiny_worker.num_kv_heads)
    assert torch.allclose(budget, (mean + 2 * std).clamp(max=1.0))
    assert (torch.tensor(profile.budgets["0.3"]).mean() < budget.mean()) and -1 <= profile.stability["0.5"] <= 1
    assert HeadProfile.from_json(profile.to_json()) == profile


def test_calibrated_budgets_keep_ceil_b_n_per_head():
    torch.manual_seed(0)
    layers = [(torch.randn(2, 50, 8), torch.randn(2, 50, 8))]
    from statekeeper.compression.attention_stats import AttentionStats

    stats = AttentionStats(1)
    stats.recent_queries = [torch.randn(4, 8, 8).half()]
    method = HeadBudgetEviction("h", "expected", budgets="calibrated", profile=[[0.2, 0.7]], sink_tokens=0,
                                recent_tokens=0)
    kept = torch.isfinite(method.compress(layers, stats).head_bias[0]).sum(1).tolist()
    assert kept == [math.ceil(0.2 * 50), math.ceil(0.7 * 50)]


def test_profiles_load_only_for_their_model_and_scorer_and_fall_back_to_uniform(tmp_path):
    profile = HeadProfile("model-a", "kvzip", 2.0, 1, {"0.5": [[0.4, 0.6]]}, {}, {}, {})
    profile_path(tmp_path, "model-a", "kvzip").write_text(profile.to_json())
    profile_path(tmp_path, "model-b", "kvzip").write_text("{not json")
    assert load_profile(tmp_path, "model-a", "kvzip") == profile
    assert load_profile(tmp_path, "model-b", "kvzip") is None and load_profile(tmp_path, "model-a", "expected") is None
    config = CompressionConfig(policy="heads", budgets="calibrated", scorer="kvzip", keep=0.5, codec="none")
    assert from_config(config, profile).profile == [[0.4, 0.6]]
    assert from_config(config, None).budgets == "uniform"
    assert from_config(CompressionConfig(policy="heads", budgets="calibrated", keep=0.3, codec="none"),
                       profile).budgets == "uniform"


def test_the_service_reports_missing_calibration_and_uses_a_profile_once_written(make_service, tmp_path):
    import asyncio

    config = CompressionConfig(policy="heads", budgets="calibrated", scorer="expected", keep=0.5)
    service = make_service(tiers=("lmdb",), compression=config)
    service.profile_dir = tmp_path / "profiles"
    assert "uniform budgets" in service.health_notes()[0]
    service._profiles.clear()
    heads, layers = service.worker.num_kv_heads, service.worker.num_layers
    budgets = [[1.0] + [0.1] * (heads - 1)] * layers
    profile = HeadProfile(service.worker.fingerprint, "expected", 2.0, 1, {"0.5": budgets}, {}, {}, {})
    service.profile_dir.mkdir()
    profile_path(service.profile_dir, service.worker.fingerprint, "expected").write_text(profile.to_json())
    assert service.health_notes() == []

    async def scenario():
        session = (await service.create(None, None)).id
        async for _ in service.turn(session, TurnRequest("Hello " * 80, max_tokens=4)):
            pass
        await service.offload(session)
        async for event in service.turn(session, TurnRequest("And?", max_tokens=4)):
            pass
        bias = service._live[session].cache.head_bias[0]
        assert bool(torch.isfinite(bias[0]).all()) and float(torch.isfinite(bias[1]).float().mean()) < 0.5

    asyncio.run(scenario())


def test_calibrated_method_names_need_a_matching_profile():
    from statekeeper.compression import by_name

    profile = HeadProfile("m", "kvzip", 2.0, 1, {"0.5": [[0.4, 0.6]]}, {}, {}, {})
    method = by_name("kvzip-calibrated@0.5+int4", profile=profile)
    assert method.inner.budgets == "calibrated" and method.inner.profile == [[0.4, 0.6]]
    for name, given in (("kvzip-calibrated@0.3", profile), ("expected-calibrated@0.5", profile),
                        ("kvzip-calibrated@0.5", None)):
        with pytest.raises(ValueError, match="calibrated"):
            by_name(name, profile=given)
