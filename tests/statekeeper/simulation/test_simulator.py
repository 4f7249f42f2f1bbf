"""The placement simulator runs the service's own tier manager and policy over a trace (issue 32)."""

import argparse
import dataclasses
import json

import pytest

from statekeeper.placement.costs import CostProfile
from statekeeper.simulation.command import main, parse_bytes, parse_tiers
from statekeeper.simulation.simulator import SimulationConfig, simulate
from statekeeper.placement.trace import TraceTurn, read, write
from statekeeper.simulation.synthetic import SyntheticTrace, synthetic


BYTE_A_TOKEN = CostProfile.tokens_only(bytes_per_token=1)


def _turn(time_s, conversation, tokens=60):
    return TraceTurn(time_s, conversation, tokens // 2, tokens - tokens // 2)


def test_each_resumed_turn_finds_its_kv_where_the_managers_lru_left_it():
    """A byte a token, 100-byte tiers, offload 1 s after a turn. a, b and c (60 tokens each) go to DRAM in
    turn: b pushes a down to the SSD, c pushes b down, and a, least recently used there, out."""
    turns = [_turn(0, "a"), _turn(10, "b"), _turn(20, "c"),
             _turn(30.0, "a"), _turn(30.2, "b"), _turn(30.4, "c"), _turn(30.6, "c")]
    report = simulate(turns, SimulationConfig([("dram", 100), ("ssd", 100)], BYTE_A_TOKEN, idle_offload_s=1))
    assert report.turns == 7
    assert dict(report.resumed) == {"recompute": 1, "ssd": 1, "dram": 1, "active": 1}
    assert dict(report.history_tokens) == {"recompute": 60, "ssd": 60, "dram": 60, "active": 120}
    assert report.recomputed_tokens == 60 and report.demotions == 2 and report.evictions == 1
    assert report.tier_bytes == {"dram": 60, "ssd": 60}  # c and b; the turns at 30 s are still active


def test_a_blob_larger_than_every_tier_is_recomputed():
    turns = [_turn(0, "a", tokens=500), _turn(100, "a")]
    report = simulate(turns, SimulationConfig([("dram", 100)], BYTE_A_TOKEN, idle_offload_s=1))
    assert dict(report.resumed) == {"recompute": 1} and report.recomputed_tokens == 500


def test_the_synthetic_day_is_ordered_seeded_and_heavy_tailed(tmp_path):
    params = SyntheticTrace(conversations=500, seed=3)
    turns = synthetic(params)
    assert turns == synthetic(params) and turns != synthetic(SyntheticTrace(conversations=500, seed=4))
    assert [t.time_s for t in turns] == sorted(t.time_s for t in turns)
    assert all(0 <= t.time_s < params.day_s and t.prompt_tokens >= 1 and t.reply_tokens >= 1 for t in turns)
    assert len({t.conversation for t in turns}) == 500
    last_seen, gaps = {}, []
    for turn in turns:
        if turn.conversation in last_seen:
            gaps.append(turn.time_s - last_seen[turn.conversation])
        last_seen[turn.conversation] = turn.time_s
    gaps.sort()
    assert gaps[len(gaps) // 4] < 300 and gaps[-len(gaps) // 20] > 3_600  # most come back soon, some hours later
    path = tmp_path / "trace.jsonl"
    write(turns, path)
    assert list(read(path)) == turns


def test_sizes_and_tiers_on_the_command_line(capsys, tmp_path):
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("100") == 100
    assert parse_tiers("dram=512MiB,ssd=2TB") == [("dram", 512 * 2**20), ("ssd", 2 * 10**12)]
    for bad in ("dram", "dram=lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_tiers(bad)
    write([_turn(0, "a"), _turn(500, "a")], tmp_path / "t.jsonl")
    CostProfile.tokens_only(bytes_per_token=2).save(tmp_path / "profile.json")
    main(["--trace", str(tmp_path / "t.jsonl"), "--tiers", "dram=1KB", "--profile", str(tmp_path / "profile.json"),
          "--policy", "lru", "--compression", "none",
          "--json", str(tmp_path / "report.json")])
    assert "dram: 1 turns" in capsys.readouterr().out
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["resumed"] == {"dram": 1} and saved["history_tokens"] == {"dram": 60} and saved["tier_bytes"] == {"dram": 120}


@pytest.mark.parametrize("compression, source", [("none", "recompute"), ("scheduled", "dram")])
def test_compressing_a_stored_blob_leaves_room_for_the_next(compression, source):
    """100 bytes of DRAM, two 60-token conversations: exact, b's offload pushes a out; compressed 6x five
    seconds after its offload, a takes 10 bytes and both stay."""
    config = SimulationConfig([("dram", 100)], CostProfile.tokens_only(1, compression_ratio=6), idle_offload_s=1,
                              compression=compression, compress_after_s=5.0)
    report = simulate([_turn(0, "a"), _turn(10, "b"), _turn(100, "a")], config)
    assert dict(report.resumed) == {source: 1}
    assert report.compressed == (0 if compression == "none" else 2)
    assert report.tier_bytes == ({"dram": 60} if compression == "none" else {"dram": 20})


def test_a_fastest_tier_past_its_full_fraction_gets_every_stored_blob_compressed():
    """As the compactor does (Compactor.due): b's offload fills DRAM to 95 of 100 bytes, so a and b are
    compressed then (6x: 10 and 6 bytes), long before their 1,000 s are up."""
    config = SimulationConfig([("dram", 100), ("ssd", 1000)], CostProfile.tokens_only(1, compression_ratio=6),
                              idle_offload_s=1, compression="scheduled", compress_after_s=1000)
    report = simulate([_turn(0, "a"), _turn(10, "b", tokens=35), _turn(20, "a")], config)
    assert report.compressed == 2 and dict(report.resumed) == {"dram": 1}
    assert report.tier_bytes == {"dram": 16, "ssd": 0}


def _slow_compression(ms_a_token: float, workers: int = 1) -> CostProfile:
    return dataclasses.replace(CostProfile.tokens_only(1, compression_ratio=6), compress_ms_linear=ms_a_token,
                               compress_workers=workers)


def test_compression_takes_the_profiles_cpu_time_and_a_returning_turn_wastes_it():
    """1 s a token: a's 60-token blob, due at its offload (1 s), would take 60 s; a comes back at 11 s."""
    config = SimulationConfig([("dram", 1000)], _slow_compression(1000.0), idle_offload_s=1,
                              compression="scheduled", compress_after_s=0.0)
    report = simulate([_turn(0, "a"), _turn(11, "a")], config)
    assert report.compressed == 0 and report.compress_cancelled == 1
    assert report.compress_cpu_s == pytest.approx(10.0) and report.compress_wasted_cpu_s == pytest.approx(10.0)
    assert dict(report.resumed) == {"dram": 1}  # the exact blob, still there


def test_one_worker_compresses_one_blob_at_a_time():
    """Three blobs due at once, 60 s each on one worker: done at 61, 121 and 181 s."""
    turns = [_turn(0, "a"), _turn(0, "b"), _turn(0, "c"), _turn(150, "d")]
    config = SimulationConfig([("dram", 1000)], _slow_compression(1000.0), idle_offload_s=1,
                              compression="scheduled", compress_after_s=0.0)
    report = simulate(turns, config)
    assert report.compress_backlog_max == 3 and report.compressed == 2  # the third is still running at 150 s
    two = simulate(turns, dataclasses.replace(config, profile=_slow_compression(1000.0, workers=2)))
    assert two.compressed == 3


def test_first_tokens_are_estimated_from_the_profile():
    """tokens_only: a recompute costs 1 ms a token, a restore nothing, so a resumed turn costs its new
    message's prefill plus, without stored state, its history's."""
    turns = [_turn(0, "a"), _turn(0.5, "a"), _turn(10, "b", tokens=500), _turn(20, "a")]
    config = SimulationConfig([("dram", 100)], BYTE_A_TOKEN, idle_offload_s=1)
    report = simulate(turns, config)
    assert dict(report.resumed) == {"active": 1, "recompute": 1}
    assert report.first_token_ms == [30.0, 120.0 + 30.0]  # the second turn's history: 60; the third's: 120


def test_the_value_policy_runs_the_synthetic_day_and_reports_its_calibration():
    turns = synthetic(SyntheticTrace(conversations=300, tenants=2, seed=1))
    config = SimulationConfig([("dram", 2_000_000), ("ssd", 20_000_000)], CostProfile.tokens_only(23_040),
                              policy="value", compression="value")
    report = simulate(turns, config)
    assert sum(report.resumed.values()) == report.turns - 300
    assert report.policy["held"] == 300 and report.policy["returns_within_hour"] > 0
    assert report.tier_bytes_over_time[0][0] == turns[0].time_s and len(report.tier_bytes_over_time) >= 23


def test_a_conversation_goes_idle_when_its_reply_ends_not_when_its_request_came():
    """A 1-second idle offload: 5.5 s after a 5-second turn's request the conversation is still active; after
    an instant one, stored."""
    config = SimulationConfig([("dram", 100)], BYTE_A_TOKEN, idle_offload_s=1)
    slow = simulate([dataclasses.replace(_turn(0, "a"), duration_s=5.0), _turn(5.5, "a")], config)
    instant = simulate([_turn(0, "a"), _turn(5.5, "a")], config)
    assert dict(slow.resumed) == {"active": 1} and dict(instant.resumed) == {"dram": 1}


@pytest.mark.parametrize("policy", ["lru", "value"])
def test_a_lossless_service_is_simulated_without_compression_under_either_policy(policy):
    """The live service never compresses a lossless conversation (COMPRESSION_POLICY=none): the forecast of a
    value-policy service shrank its blobs by the 8x prior all the same, and promised hits it never gets."""
    from statekeeper.simulation.simulator import service_compression

    assert service_compression(policy, lossless=True) == "none"
    assert service_compression(policy, lossless=False) == ("value" if policy == "value" else "scheduled")
