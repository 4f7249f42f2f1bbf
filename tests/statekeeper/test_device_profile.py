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

    assert profile_lengths(131072) == (1024, 4096, 16384)
    assert profile_lengths(8192) == (1024, 4096, 8192)
    assert profile_lengths(4096) == (256, 1024, 4096)
    assert profile_lengths(2048) == (128, 512, 2048)
    assert len(set(profile_lengths(3))) == 3 and max(profile_lengths(3)) == 3
