"""`statekeeper plan`: a forecast per tier mix, and the smallest growth of the last tier that reaches a target."""

import dataclasses

import pytest

from statekeeper.placement.costs import CostProfile
from statekeeper.simulation.planner import main, scaled_compression


def test_a_sampled_day_gets_its_share_of_the_compression_cores():
    profile = dataclasses.replace(CostProfile.tokens_only(1), compress_ms_linear=2.0, compress_workers=400)
    assert scaled_compression(profile, 200.0).compress_workers == 2
    assert scaled_compression(profile, 200.0).compress_ms_linear == 2.0
    one = scaled_compression(profile.with_workers(1), 200.0)  # a two-hundredth of a core: one core, 200x slower
    assert (one.compress_workers, one.compress_ms_linear) == (1, pytest.approx(400.0))


def test_the_plan_prints_each_mix_and_what_reaches_the_target(tmp_path, capsys):
    CostProfile.tokens_only(23_040).save(tmp_path / "profile.json")
    main(["--conversations-per-day", "2000", "--sample-conversations", "500", "--profile", str(tmp_path / "profile.json"),
          "--tiers", "dram=64MiB,lmdb=256MiB", "--tiers", "dram=64MiB,lmdb=64GiB", "--target-hit-rate", "0.95"])
    out = capsys.readouterr().out
    assert "500 of 2,000 conversations simulated (1/4 of every budget)" in out
    small, large = out.split("\ndram 64 MiB, lmdb ")[1:]
    rate = lambda text: float(text.split("hit rate ")[1].split("%")[0])  # noqa: E731
    assert rate(small) < 95 <= rate(large) and "to reach 95%: lmdb" in small and "to reach" not in large


def test_tiers_the_profile_cannot_cost_are_refused(tmp_path, capsys):
    CostProfile.tokens_only(1, tiers=("dram",)).save(tmp_path / "profile.json")
    with pytest.raises(SystemExit):
        main(["--conversations-per-day", "10", "--profile", str(tmp_path / "profile.json"), "--tiers", "dram=1GB,tape=1TB"])
    assert "no read costs for tier(s) tape" in capsys.readouterr().err


def test_every_shipped_profile_loads_by_name_and_says_where_its_numbers_come_from():
    from statekeeper.simulation.command import PROFILES, parse_profile

    names = sorted(path.stem for path in PROFILES.glob("*.json"))
    assert "smollm2-135m-xeon-1thread" in names and len(names) >= 3
    for name in names:
        profile = parse_profile(name)
        assert profile.notes and profile.bytes_per_token > 0 and profile.recompute_ms(1000) > 0
        assert profile.restore_ms("dram", 1000, compressed=True) < profile.recompute_ms(1000)


def test_without_a_day_size_the_plan_finds_how_many_conversations_a_mix_keeps_warm(tmp_path, capsys):
    from statekeeper.simulation.planner import conversations_kept_warm

    profile = CostProfile.tokens_only(23_040)
    small = conversations_kept_warm(0.9, [("dram", 1 << 30)], profile, "lru", 300.0, 300, 1, 0)
    large = conversations_kept_warm(0.9, [("dram", 8 << 30)], profile, "lru", 300.0, 300, 1, 0)
    assert small is not None and large is not None and large > 4 * small  # eight times the bytes
    profile.save(tmp_path / "profile.json")
    main(["--profile", str(tmp_path / "profile.json"), "--tiers", "dram=1GiB", "--target-hit-rate", "0.9",
          "--policy", "lru", "--sample-conversations", "300"])
    assert f"keeps 90% of resumed turns warm up to ~{small:,} conversations a day" in capsys.readouterr().out


def test_a_trace_of_several_days_is_planned_as_so_many_days(tmp_path, capsys):
    """TRACE_FILE grows day after day: a two-day trace's conversations were taken for one day's, each budget
    scaled to twice the traffic it serves, and its totals called a day's."""
    from statekeeper.placement.trace import write
    from statekeeper.simulation.synthetic import SyntheticTrace, synthetic

    day = synthetic(SyntheticTrace(200, seed=3))
    second = [dataclasses.replace(turn, time_s=turn.time_s + 86_400.0, conversation=turn.conversation + "-2")
              for turn in day]
    write(day + second, tmp_path / "trace.jsonl")
    CostProfile.tokens_only(23_040).save(tmp_path / "profile.json")
    main(["--trace", str(tmp_path / "trace.jsonl"), "--conversations-per-day", "200", "--sample-conversations",
          "400", "--profile", str(tmp_path / "profile.json"), "--tiers", "dram=64MiB"])
    out = capsys.readouterr().out
    assert "over 2 days" in out and "(1/1 of every budget)" in out
