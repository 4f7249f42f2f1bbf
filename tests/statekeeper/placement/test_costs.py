"""The cost profile the policy weighs by follows the service's own compressions (MeasuredCompression): the
compression ratio and the compression CPU move from their priors to what was measured, each prior counting
as PRIOR_WEIGHT compressions."""

import pytest

from scheduler.plan import ComputeProfile, LoadProfile
from statekeeper.placement.costs import PRIOR_WEIGHT, SCORING_PREFILLS, CostProfile, MeasuredCompression
from statekeeper.placement.policy import ValuePolicy


def service_profile() -> CostProfile:
    """A linear prefill of 2 ms a token after 10 ms, as a restore profile measured at start would give."""
    return CostProfile.of_service(1000, ComputeProfile(10.0, 2.0, 0.0), {"dram": LoadProfile(0.1, 1e9)})


# The prior in prefills of a 1,000-token blob: SCORING_PREFILLS of the prefill's per-token part (2,000 ms) over
# the whole prefill (2,010 ms).
PRIOR_PREFILLS = SCORING_PREFILLS * 2000 / 2010


def test_with_nothing_measured_the_priors_apply():
    measured = MeasuredCompression(service_profile())
    assert measured.profile() == service_profile()
    assert measured.report() == {"compressions_seen": 0, "compressions_timed": 0, "compression_ratio": 8.0,
                                 "compress_prefills": round(PRIOR_PREFILLS, 3)}


def test_measured_compressions_move_the_ratio_and_cpu_from_their_priors():
    measured = MeasuredCompression(service_profile())
    # Two blobs of 500 tokens: 4x smaller, and 3 prefills of CPU each (prefill of 500 tokens: 1,010 ms).
    for _ in range(2):
        measured.add(500, exact_bytes=400_000, stored_bytes=100_000, cpu_ms=3 * 1010.0)
    measured.add(500, exact_bytes=400_000, stored_bytes=100_000, cpu_ms=None)  # compressed on the model thread
    prior_exact = PRIOR_WEIGHT * 400_000
    ratio = (prior_exact + 1_200_000) / (prior_exact / 8.0 + 300_000)
    prefills = (PRIOR_WEIGHT * PRIOR_PREFILLS + 2 * 3.0) / (PRIOR_WEIGHT + 2)
    profile = measured.profile()
    assert profile.compression_ratio == pytest.approx(ratio)
    assert profile.compress_cpu_ms(1000) == pytest.approx(prefills * 2010)
    assert measured.report()["compressions_seen"] == 3 and measured.report()["compressions_timed"] == 2
    assert measured.report()["compress_prefills"] == pytest.approx(prefills, abs=1e-3)


def test_a_token_counting_profile_has_no_compression_cpu_to_scale():
    measured = MeasuredCompression(CostProfile.tokens_only(bytes_per_token=10))
    measured.add(100, exact_bytes=1000, stored_bytes=250, cpu_ms=50.0)
    assert measured.profile().compress_cpu_ms(1000) == 0.0
    assert measured.report()["compress_prefills"] is None and measured.report()["compression_ratio"] < 8.0


def test_the_policy_weighs_by_what_it_measured():
    policy = ValuePolicy(service_profile(), ["dram"])
    policy.compressed(500, 400_000, 50_000, 1010.0)  # 8x, one prefill of CPU
    assert policy.costs.compression_ratio == pytest.approx(8.0)
    assert policy.costs.compress_cpu_ms(500) < service_profile().compress_cpu_ms(500)
    assert policy.report()["compression"]["compressions_timed"] == 1
