import math

import pytest
import torch

from statekeeper.chat import ChatFormatter
from statekeeper.compression.head_budget import HeadBudgetEviction
from statekeeper.compression.head_profile import HeadProfile
from statekeeper.evaluation.calibration import calibrate_heads, damage_parts, pair_damage, retention_ratios
from statekeeper.evaluation.teacher_forcing import sharegpt_cases


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


FILLER = [[("user", "Tell me about the history of Rome."), ("assistant", "Rome was not built in a day. " * 3)] * 6]


def test_pair_damage_ranks_every_adjacent_pair_least_damaging_first(tiny_worker):
    formatter = ChatFormatter(tiny_worker.tokenizer)
    eos = tiny_worker.tokenizer.eos_token_id
    cases = sharegpt_cases(formatter, FILLER, target_tokens=60, count=1, end_of_turn=eos)
    ranked = pair_damage(tiny_worker, cases, ["v", "kv"], log=lambda line: None)
    num_layers = tiny_worker.num_layers
    assert set(ranked) == {"v", "kv"}
    for part, pairs in ranked.items():
        assert sorted(pair for pair, _ in pairs) == [(i, i + 1) for i in range(num_layers - 1)]
        kls = [kl for _, kl in pairs]
        assert kls == sorted(kls) and kls[-1] > 0


def test_damage_parts_are_read_from_plain_and_composed_names():
    names = ["none", "damage", "damage-kv@0.4", "damage/kvzip-uniform@0.5+int4", "damage-k/expected@0.3", "krul-kv"]
    assert damage_parts(names) == ["k", "kv", "v"]
    assert damage_parts(["kvzip@0.5", "krul/kvzip-merge@0.5"]) == []


def test_the_taxonomy_is_measured_per_head_on_teacher_forced_continuations(tiny_worker):
    from statekeeper.evaluation.calibration import calibrate_taxonomy
    from statekeeper.evaluation.teacher_forcing import ContinuationCase

    torch.manual_seed(0)
    cases = [ContinuationCase(torch.randint(5, 200, (n,)).tolist(), torch.randint(5, 200, (40,)).tolist(), [(5, 40)])
             for n in (120, 150)]
    taxonomy = calibrate_taxonomy(tiny_worker, cases, live_rho=1.0, tau_stable=0.5, tau_sim=0.5, window=8,
                                  log=lambda line: None)
    layers, heads = tiny_worker.num_layers, tiny_worker.num_kv_heads
    assert len(taxonomy.roles) == layers and all(len(roles) == heads for roles in taxonomy.roles)
    assert all(0.0 <= s <= 1.0 for layer in taxonomy.stability for s in layer) and taxonomy.samples == 2
    assert all(taxonomy.pair_overlap[layer][head][head] == 1.0 for layer in range(layers) for head in range(heads))
    assert taxonomy.live_budgets == [[1.0] * heads] * layers  # a live share of 1.0 keeps everything
