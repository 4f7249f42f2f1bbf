"""Planning a GPU restore from the device's profile (statekeeper/device_profile.py; measured on a GPU only)."""

import pytest

from scheduler.plan import ComputeProfile, LoadProfile
from statekeeper.device_profile import DeviceProfile, plan

LINK = LoadProfile(0.01, 25_000.0)  # 25 GB/s
COMPUTE = ComputeProfile(1.0, 0.01, 0.0)  # 1 ms a forward, 0.01 ms a token


def test_a_split_that_gains_little_is_not_taken():
    # 4,096 tokens of 23,040 bytes load in ~3.8 ms against the message's 2 ms: recomputing a prefix would save
    # ~2% of the restore, under MIN_SPLIT_GAIN, so all of it loads
    restore = plan(DeviceProfile("gpu", LINK, 50_000.0, COMPUTE), 4096, 100, 23_040)
    assert restore.recompute_tokens == 0 and restore.compute_ms == pytest.approx(2.0)


def test_a_link_slower_than_the_compute_recomputes_a_prefix_that_balances_the_two():
    restore = plan(DeviceProfile("gpu", LINK, 50_000.0, COMPUTE), 16_384, 100, 23_040)
    assert 0 < restore.recompute_tokens < 16_384
    assert restore.compute_ms == pytest.approx(restore.load_ms, rel=0.01)  # Krul eq. 1


def test_a_compressed_restore_is_not_split_and_pays_the_link_and_the_decode():
    profile = DeviceProfile("gpu", LINK, 50_000.0, COMPUTE)
    restore = plan(profile, 4096, 100, 3_000, compressed=True)
    assert restore.recompute_tokens == 0
    assert restore.load_ms == pytest.approx(0.01 + 4096 * 3_000 * (1 / 25e9 + 1 / 50e9) * 1e3)


def test_a_profile_that_cannot_be_measured_leaves_restores_unplanned(tiny_worker):
    from statekeeper.device_profile import measure_at_start

    assert measure_at_start(tiny_worker) is None  # a CPU worker has no CUDA events to time with


def test_an_unmeasured_decode_rate_plans_with_the_link_alone():
    restore = plan(DeviceProfile("gpu", LINK, None, COMPUTE), 4096, 100, 3_000, compressed=True)
    assert restore.load_ms == pytest.approx(0.01 + 4096 * 3_000 / 25e9 * 1e3)


def test_the_prefills_timed_at_start_reach_the_lengths_restores_have():
    """A GPU's short prefills cost their host time whatever their length: the profile times long ones, up
    to the model's context, always three distinct lengths (the fit's minimum)."""
    from statekeeper.device_profile import profile_lengths

    assert profile_lengths(131072) == (64, 1024, 4096, 16384)
    assert profile_lengths(8192) == (64, 1024, 4096, 8192)
    assert profile_lengths(4096) == (64, 256, 1024, 4096)
    assert profile_lengths(2048) == (64, 128, 512, 2048)
    assert profile_lengths(512) == (32, 128, 512)  # no shorter forward than the fit's own
    assert len(set(profile_lengths(3))) == 3 and max(profile_lengths(3)) == 3


def host_bound_gpu_ms(tokens: int) -> float:
    """A prefill on a GPU whose forwards cost 30 ms of the host's time to queue up to ~1,200 tokens."""
    return max(30.0, 0.02 * tokens + 2.5e-6 * tokens * tokens)


def test_a_gpu_whose_forwards_cost_the_host_time_recomputes_no_prefix_to_save_a_little_copying():
    """Llama 8B's 16k tokens (128 KiB a token) over 53 GB/s copy in ~40 ms against a 30 ms message: a split
    needs a second forward, another 30 ms. Fitted through long prefills only, the profile priced the message
    at ~1 ms and planned a 917-token prefix (on an H100, 963 tokens: 2.13x hot, against 1.20x unsplit)."""
    from statekeeper.device_profile import profile_lengths

    compute = ComputeProfile.fit([(n, host_bound_gpu_ms(n)) for n in profile_lengths(131072)])
    restore = plan(DeviceProfile("gpu", LoadProfile(0.035, 53_000.0), None, compute), 16_384, 48, 131_072)
    assert restore.recompute_tokens == 0
    assert restore.compute_ms == pytest.approx(30.0, rel=0.02)


def test_the_message_costs_at_least_what_its_tokens_add_to_the_whole_history():
    compute = ComputeProfile(1.0, 0.01, 1e-5)  # attention grows with the history
    restore = plan(DeviceProfile("gpu", LINK, None, compute), 16_384, 100, 100)
    assert restore.recompute_tokens == 0
    assert restore.compute_ms == pytest.approx(compute.prefill_ms(16_484) - compute.prefill_ms(16_384))
