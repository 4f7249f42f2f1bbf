import json
from dataclasses import asdict

import pytest

from scheduler.plan import ComputeProfile, LoadProfile, StoredLayer, plan_restore

# SmolLM2-like: 30 layers of 1,536 bytes per token (fp32 K and V of 3 heads x 64 dims).
LAYERS = [StoredLayer(1536.0)] * 30
COMPUTE = ComputeProfile(fixed_ms=20.0, linear_ms=2.5, quadratic_ms=0.0002)  # ~5.8 s for 2,000 tokens


def _extremes(n, layers, load):
    return COMPUTE.prefill_ms(n), load.read_ms(sum(layer.bytes_per_token for layer in layers) * n)


def test_fast_tier_loads_everything():
    plan = plan_restore(2000, LAYERS, COMPUTE, LoadProfile(latency_ms=0.1, megabytes_per_s=5000))
    assert plan.recompute_tokens == 0 and plan.compute_ms == 0 and plan.load_ms < 20


@pytest.mark.parametrize("bandwidth", [50.0, 20.0, 5.0])
def test_slow_tier_balances_the_two_streams_and_beats_both_extremes(bandwidth):
    load = LoadProfile(latency_ms=2.0, megabytes_per_s=bandwidth)
    plan = plan_restore(2000, LAYERS, COMPUTE, load)
    recompute_all, load_all = _extremes(2000, LAYERS, load)
    assert 0 < plan.recompute_tokens < 2000
    assert plan.total_ms <= min(recompute_all, load_all)
    assert abs(plan.compute_ms - plan.load_ms) <= 0.01 * plan.total_ms + COMPUTE.linear_ms + 2 * 30 * 1536 / bandwidth / 1e3
    assert plan.per_layer(30) == [(plan.recompute_tokens, (plan.recompute_tokens, 2000))] * 30
    assert plan.load_range == (plan.recompute_tokens, 2000)


def test_slower_loading_recomputes_more():
    lengths = [plan_restore(2000, LAYERS, COMPUTE, LoadProfile(1.0, mbs)).recompute_tokens for mbs in (200, 50, 20, 5)]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


def test_shared_layers_load_nothing_so_less_is_recomputed():
    load = LoadProfile(1.0, 20.0)
    shared = [StoredLayer(1536.0)] * 18 + [StoredLayer(1536.0), StoredLayer(0.0)] * 6  # 6 pairs stored once
    assert plan_restore(2000, shared, COMPUTE, load).recompute_tokens < plan_restore(2000, LAYERS, COMPUTE, load).recompute_tokens


def test_a_blob_without_its_prefix_recomputes_at_least_that_prefix():
    plan = plan_restore(2000, LAYERS, COMPUTE, LoadProfile(0.1, 5000), stored_from=300)
    assert plan.recompute_tokens == 300 and plan.load_range == (300, 2000)


def test_compute_profile_fit_recovers_its_coefficients_and_needs_three_lengths():
    truth = ComputeProfile(15.0, 2.0, 0.0005)
    fitted = ComputeProfile.fit([(n, truth.prefill_ms(n)) for n in (256, 512, 1024, 2048)])
    assert (fitted.fixed_ms, fitted.linear_ms, fitted.quadratic_ms) == pytest.approx((15.0, 2.0, 0.0005), rel=1e-6)
    assert fitted.prefill_ms(4000) == pytest.approx(truth.prefill_ms(4000), rel=1e-6)  # beyond the samples
    with pytest.raises(ValueError):
        ComputeProfile.fit([(256, 1.0), (256, 1.1), (512, 2.0)])


def test_empty_history_plans_nothing():
    plan = plan_restore(0, LAYERS, COMPUTE, LoadProfile(1.0, 1.0))
    assert plan.total_ms == 0 and plan.recompute_tokens == 0


def test_a_split_that_barely_beats_loading_is_not_worth_its_two_streams():
    slow_start = ComputeProfile(fixed_ms=400.0, linear_ms=2.5, quadratic_ms=0.0)  # a split gains ~1% here
    load = LoadProfile(latency_ms=0.0, megabytes_per_s=200.0)
    assert plan_restore(2000, LAYERS, slow_start, load, min_split_gain=0.0).recompute_tokens > 0
    plan = plan_restore(2000, LAYERS, slow_start, load)
    assert plan.recompute_tokens == 0 and plan.compute_ms == 0


def test_compute_profile_follows_its_measured_points_and_stays_increasing():
    # A curve the quadratic cannot follow: a step where prefills start a second chunk.
    samples = [(64, 100.0), (256, 300.0), (512, 600.0), (600, 900.0), (1024, 1500.0), (1000, 1400.0)]
    profile = ComputeProfile.fit(samples + [(128, 90.0)])  # a noisy point below its shorter neighbour
    assert profile.prefill_ms(600) == pytest.approx(900.0) and profile.prefill_ms(556) == pytest.approx(750.0)
    assert profile.prefill_ms(128) == pytest.approx(100.0)  # never cheaper than a shorter prefill
    assert profile.prefill_ms(64) == pytest.approx(100.0) and profile.prefill_ms(1024) == pytest.approx(1500.0)
    times = [profile.prefill_ms(n) for n in range(1, 3000, 7)]
    assert all(b >= a for a, b in zip(times, times[1:])) and 0 < times[0] < 100.0
    assert ComputeProfile.from_dict(json.loads(json.dumps(asdict(profile)))) == profile


def test_load_profile_follows_its_measured_points():
    line = LoadProfile(0.5, 5000.0)
    measured = LoadProfile(0.5, 5000.0, ((1_000_000, 0.5), (10_000_000, 4.0), (100_000_000, 20.5)))
    assert measured.read_ms(10_000_000) == pytest.approx(4.0) and line.read_ms(10_000_000) == pytest.approx(2.5)
    assert measured.read_ms(55_000_000) == pytest.approx(12.25)
    assert measured.read_ms(200_000_000) == pytest.approx(line.read_ms(200_000_000) * 20.5 / line.read_ms(100_000_000))
    assert LoadProfile.from_dict(json.loads(json.dumps(asdict(measured)))) == measured


def test_a_background_chunk_fits_its_time_budget_where_the_context_makes_tokens_dearer():
    """chunk_within sizes a background prefill job: a forward's fixed cost plus the recompute curve's growth over
    the chunk stays within the budget, so chunks shrink as the context (attention) makes each token dearer."""
    compute = ComputeProfile(fixed_ms=2.0, linear_ms=1.0, quadratic_ms=0.0001)
    for context in (0, 500, 4000):
        chunk = compute.chunk_within(context, 50.0, most=512)
        cost = lambda n: compute.prefill_ms(context + n) - compute.prefill_ms(context) + compute.fixed_ms  # noqa: E731
        assert cost(chunk) <= 50.0 < cost(chunk + 1)
    assert compute.chunk_within(4000, 50.0, 512) < compute.chunk_within(0, 50.0, 512)
    assert compute.chunk_within(0, 1e6, most=512) == 512  # never past a prefill chunk
    assert compute.chunk_within(0, 0.0, most=512) == 16  # a job still makes progress on the slowest machine
