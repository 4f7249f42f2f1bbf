"""The placement simulator runs the service's own tier manager and policy over a trace (issue 32)."""

import argparse
import json

import pytest

from statekeeper.simulation.command import main, parse_bytes, parse_tiers
from statekeeper.simulation.simulator import SimulationConfig, simulate
from statekeeper.simulation.trace import SyntheticTrace, TraceTurn, read, synthetic, write


def _turn(time_s, conversation, tokens=60):
    return TraceTurn(time_s, conversation, tokens // 2, tokens - tokens // 2)


def test_each_resumed_turn_finds_its_kv_where_the_managers_lru_left_it():
    """A byte a token, 100-byte tiers, offload 1 s after a turn. a, b and c (60 tokens each) go to DRAM in
    turn: b pushes a down to the SSD, c pushes b down, and a, least recently used there, out."""
    turns = [_turn(0, "a"), _turn(10, "b"), _turn(20, "c"),
             _turn(30.0, "a"), _turn(30.2, "b"), _turn(30.4, "c"), _turn(30.6, "c")]
    report = simulate(turns, SimulationConfig([("dram", 100), ("ssd", 100)], bytes_per_token=1, idle_offload_s=1))
    assert report.turns == 7
    assert dict(report.resumed) == {"recompute": 1, "ssd": 1, "dram": 1, "active": 1}
    assert dict(report.history_tokens) == {"recompute": 60, "ssd": 60, "dram": 60, "active": 120}
    assert report.recomputed_tokens == 60 and report.demotions == 2 and report.evictions == 1
    assert report.tier_bytes == {"dram": 60, "ssd": 60}  # c and b; the turns at 30 s are still active


def test_a_blob_larger_than_every_tier_is_recomputed():
    turns = [_turn(0, "a", tokens=500), _turn(100, "a")]
    report = simulate(turns, SimulationConfig([("dram", 100)], bytes_per_token=1, idle_offload_s=1))
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
    main(["--trace", str(tmp_path / "t.jsonl"), "--tiers", "dram=1KB", "--bytes-per-token", "2",
          "--json", str(tmp_path / "report.json")])
    assert "dram: 1 turns" in capsys.readouterr().out
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["resumed"] == {"dram": 1} and saved["history_tokens"] == {"dram": 60} and saved["tier_bytes"] == {"dram": 120}


@pytest.mark.parametrize("compress_after_s, source", [(None, "recompute"), (5.0, "dram")])
def test_compressing_a_stored_blob_leaves_room_for_the_next(compress_after_s, source):
    """100 bytes of DRAM, two 60-token conversations: exact, b's offload pushes a out; compressed 6x five
    seconds after its offload, a takes 10 bytes and both stay."""
    config = SimulationConfig([("dram", 100)], bytes_per_token=1, idle_offload_s=1, compress_after_s=compress_after_s,
                              compression_ratio=6)
    report = simulate([_turn(0, "a"), _turn(10, "b"), _turn(100, "a")], config)
    assert dict(report.resumed) == {source: 1}
    assert report.compressed == (0 if compress_after_s is None else 2)
    assert report.tier_bytes == ({"dram": 60} if compress_after_s is None else {"dram": 20})


def test_a_fastest_tier_past_its_full_fraction_gets_every_stored_blob_compressed():
    """As the compactor does (Compactor.due): b's offload fills DRAM to 95 of 100 bytes, so a and b are
    compressed then (6x: 10 and 6 bytes), long before their 1,000 s are up."""
    config = SimulationConfig([("dram", 100), ("ssd", 1000)], bytes_per_token=1, idle_offload_s=1,
                              compress_after_s=1000, compression_ratio=6)
    report = simulate([_turn(0, "a"), _turn(10, "b", tokens=35), _turn(20, "a")], config)
    assert report.compressed == 2 and dict(report.resumed) == {"dram": 1}
    assert report.tier_bytes == {"dram": 16, "ssd": 0}
