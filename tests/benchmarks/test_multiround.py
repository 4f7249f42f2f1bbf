"""benchmarks/multiround.py's runs and report, with a fake service (tests/benchmarks/fakes.py) for the real one."""

import json
import subprocess

import pytest

from benchmarks import multiround
from benchmarks.harness import service_choices
from tests.benchmarks.fakes import FakeService, turn

USERS = [["hello", "again"], ["hi", "more"]]


@pytest.fixture
def fake_service(monkeypatch):
    """multiround.main with the fake service, two users of two rounds, and a replay whose every turn succeeds."""
    FakeService.starts, FakeService.measured_in = [], {}
    monkeypatch.setattr(multiround, "ServiceProcess", FakeService)
    monkeypatch.setattr(multiround, "pick_users", lambda *args: USERS)

    async def replay(url, schedule, config, args, admin_token):
        turns = [turn(user, round_) for user, messages in enumerate(USERS) for round_ in range(len(messages))]
        return {"wall_s": 10.0, "turns": turns, "polls": [], "admin": FakeService.admin(url)}

    monkeypatch.setattr(multiround, "replay", replay)
    monkeypatch.setattr(multiround, "admin_stats", lambda url, admin_token: FakeService.admin(url))
    return FakeService


def test_every_timed_start_reads_measurements_an_untimed_start_made(fake_service, tmp_path):
    multiround.main(["--configs", "default,lossless,none", "--repeats", "2", "--json", str(tmp_path / "out.json")])
    measuring = [start for start in fake_service.starts if start["measured"]]
    assert len(measuring) == 1 and fake_service.starts[0]["measured"]  # the one untimed start, before the others
    assert len(fake_service.starts) == 7 and len(json.loads((tmp_path / "out.json").read_text())["runs"]) == 6


def test_none_runs_the_measured_kv_dtype_and_gemm_rows(fake_service, monkeypatch, tmp_path):
    monkeypatch.setattr(service_choices, "default_gemm", lambda: "bfloat16")
    multiround.main(["--configs", "default,none", "--json", str(tmp_path / "out.json")])
    none = next(start for start in fake_service.starts if start["env"].get("STATEKEEPER_RESTORE_PLANNING") == "false")
    assert none["env"]["STATEKEEPER_KV_DTYPE"] == "bfloat16" and none["env"]["STATEKEEPER_GEMM_ROWS"] == "16"
    saved = json.loads((tmp_path / "out.json").read_text())
    default, none = saved["summaries"][0]
    assert default["choices"] == none["choices"] == {"kv_dtype": "bfloat16", "gemm": "bfloat16", "gemm_rows": 16}
    assert multiround.ratio(saved["summaries"][0], "default", "none", "wall_s") == 1.0


def test_no_ratio_between_runs_of_other_kernels(fake_service, tmp_path, capsys):
    baseline_repo = tmp_path / "baseline"
    (baseline_repo / "statekeeper").mkdir(parents=True)
    fake_service.measured_in = {baseline_repo: {"gemm_rows": 48}}  # it rejected the shared measurements
    multiround.main(["--configs", "default,baseline,lossless", "--baseline-repo", str(baseline_repo),
                     "--json", str(tmp_path / "out.json")])
    summaries = json.loads((tmp_path / "out.json").read_text())["summaries"][0]
    why = "bfloat16 GEMM from 16 rows vs bfloat16 GEMM from 48 rows"
    assert multiround.ratio(summaries, "default", "baseline", "ttft_p50_ms") is None
    assert multiround.why_not_comparable_runs(summaries, "default", "baseline") == why
    assert multiround.ratio(summaries, "default", "lossless", "wall_s") == 1.0
    assert f"default/baseline not comparable: {why}" in capsys.readouterr().out


def test_a_configuration_that_sets_a_choice_still_compares_on_it(fake_service, tmp_path, capsys):
    multiround.main(["--configs", "lossless,kv-fp32", "--json", str(tmp_path / "out.json")])
    summaries = json.loads((tmp_path / "out.json").read_text())["summaries"][0]
    assert multiround.ratio(summaries, "kv-fp32", "lossless", "wall_s") == 1.0  # the KV dtype is what it measures
    assert "KV float32, bfloat16 GEMM from 16 rows" in capsys.readouterr().out


def test_old_results_without_choices_still_compare():
    old = [{"config": "default", "wall_s": 12.0}, {"config": "lossless", "wall_s": 10.0}]
    assert multiround.ratio(old, "default", "lossless", "wall_s") == 1.2


def _saved_run(config: str, gemm_rows: int, path) -> None:
    """A --json file of one repeat of `config` and lossless, `config` having taken the GEMM from `gemm_rows`."""
    turns = [turn(0, 0), turn(0, 1, ttft_ms=200.0)]
    admin = {"kv_dtype": {"dtype": "bfloat16"}, "dense_rows": {"rows": 16, "gemm": "bfloat16"}}
    other = admin | {"dense_rows": {"rows": gemm_rows, "gemm": "bfloat16"}}
    runs = [{"config": "lossless", "wall_s": 10.0, "turns": turns, "admin": admin},  # a file from before "choices"
            {"config": config, "wall_s": 10.0, "turns": turns, "admin": other}]
    path.write_text(json.dumps({"schedule": [], "runs": runs}))


def test_pooling_divides_only_runs_of_the_same_kernels(tmp_path):
    _saved_run("default", 16, tmp_path / "same.json")
    _saved_run("baseline", 48, tmp_path / "other.json")
    table = multiround.pooled_table([tmp_path / "same.json", tmp_path / "other.json"])
    default = next(line for line in table.splitlines() if line.startswith("| default "))
    baseline = next(line for line in table.splitlines() if line.startswith("| baseline "))
    assert "| 1.000 | 1.000 |" in default
    assert "not comparable: bfloat16 GEMM from 48 rows vs bfloat16 GEMM from 16 rows" in baseline


def _run(config: str, turns: list[dict], wall_s: float = 10.0) -> dict:
    return {"config": config, "wall_s": wall_s, "turns": turns, "admin": {}, "start_s": 1.0, "stop_s": 0.5}


def test_ttft_ratios_pair_the_turns_that_succeeded_in_both():
    default = _run("default", [turn(0, 0), turn(0, 1, ttft_ms=100.0), turn(1, 0), turn(1, 1, error="boom")])
    lossless = _run("lossless", [turn(0, 0), turn(0, 1, ttft_ms=100.0), turn(1, 0), turn(1, 1, ttft_ms=1000.0)])
    summaries = [multiround.summarize(default), multiround.summarize(lossless)]
    assert multiround.ratio(summaries, "default", "lossless", "ttft_p95_ms") == 1.0  # not 100 over 955
    assert multiround.ratio(summaries, "lossless", "default", "ttft_p50_ms") == 1.0


def test_a_configuration_with_errors_does_not_meet_its_targets():
    ok = [turn(0, 0), turn(0, 1, ttft_ms=100.0), turn(1, 0), turn(1, 1, ttft_ms=100.0)]
    default = _run("default", ok[:3] + [turn(1, 1, error="boom")])
    slower = [t | {"ttft_ms": 300.0, "latency_ms": 800.0} for t in ok]
    runs = [default, _run("lossless", ok), _run("none", slower, wall_s=20.0)]
    lines = multiround.target_lines([[multiround.summarize(run) for run in runs]])
    assert lines == ["repeat 1: default/lossless service time 1.000× (≤ 1.03; wall 1.000×), p95 TTFT 1.000× "
                     "(≤ 1.1); default and lossless beat none in both: True; errors: default 1 -> targets NOT met"]


def test_pooled_ratios_pair_the_turns_that_succeeded_in_both(tmp_path):
    lossless = [turn(0, 0), turn(0, 1, ttft_ms=100.0), turn(1, 0), turn(1, 1, error="boom")]
    default = [turn(0, 0), turn(0, 1, ttft_ms=100.0), turn(1, 0), turn(1, 1, ttft_ms=900.0)]
    runs = [_run("lossless", lossless) | {"repeat": 0}, _run("default", default) | {"repeat": 0}]
    (tmp_path / "run.json").write_text(json.dumps({"schedule": [], "runs": runs}))
    lines = multiround.pooled_table([tmp_path / "run.json"]).splitlines()
    default_row = next(line for line in lines if line.startswith("| default "))
    lossless_row = next(line for line in lines if line.startswith("| lossless "))
    assert "| 1.000 | 1.000 |" in default_row  # its 900 ms turn failed on lossless's side
    assert lossless_row.endswith("| 1 |") and default_row.endswith("| 0 |")  # errors, beside the figures


def _git_checkout(path) -> str:
    """A git repository at `path` holding a statekeeper folder, committed; its commit."""
    (path / "statekeeper").mkdir(parents=True)
    (path / "statekeeper" / "__init__.py").write_text("")
    git = ["git", "-C", str(path), "-c", "user.email=t@example.com", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "baseline"], check=True)
    return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_the_baseline_checkouts_commit_is_recorded(fake_service, tmp_path):
    commit = _git_checkout(tmp_path / "baseline")
    multiround.main(["--configs", "default,baseline", "--baseline-repo", str(tmp_path / "baseline"),
                     "--json", str(tmp_path / "out.json")])
    machine = json.loads((tmp_path / "out.json").read_text())["machine"]
    assert machine["baseline_commit"] == commit and machine["commit"]


def _saved_commits(path, commit: str, baseline_commit: str | None) -> None:
    runs = [_run(config, [turn(0, 0), turn(0, 1)]) for config in ("default", "baseline")]
    machine = {"commit": commit} | ({"baseline_commit": baseline_commit} if baseline_commit else {})
    path.write_text(json.dumps({"schedule": [], "runs": runs, "machine": machine}))


def test_pooling_refuses_runs_of_other_commits(tmp_path):
    _saved_commits(tmp_path / "a.json", "abc1234", "1" * 40)
    _saved_commits(tmp_path / "b.json", "abc1234", "2" * 40)
    with pytest.raises(SystemExit, match="baseline"):
        multiround.pooled_table([tmp_path / "a.json", tmp_path / "b.json"])
    _saved_commits(tmp_path / "c.json", "def5678", "1" * 40)
    with pytest.raises(SystemExit, match="default"):
        multiround.pooled_table([tmp_path / "a.json", tmp_path / "c.json"])


def test_pooling_takes_a_file_from_before_the_baseline_commit_was_recorded(tmp_path):
    _saved_commits(tmp_path / "a.json", "abc1234", "1" * 40)
    _saved_commits(tmp_path / "old.json", "abc1234", None)
    assert "| baseline |" in multiround.pooled_table([tmp_path / "a.json", tmp_path / "old.json"])


def test_the_wall_time_target_is_taken_on_service_time():
    def turns(latency_ms: float, ttft_ms: float = 100.0) -> list[dict]:
        return [turn(user, round_, ttft_ms=ttft_ms, latency_ms=latency_ms) for user in (0, 1) for round_ in (0, 1)]

    runs = [_run("default", turns(500.0)), _run("lossless", turns(400.0)),  # the same wall time: think time
            _run("none", turns(800.0, ttft_ms=300.0))]
    summaries = [multiround.summarize(run) for run in runs]
    assert summaries[0]["service_s"] == 2.0
    assert multiround.ratio(summaries, "default", "lossless", "service_s") == 1.25
    lines = multiround.target_lines([summaries])
    assert lines == ["repeat 1: default/lossless service time 1.250× (≤ 1.03; wall 1.000×), p95 TTFT 1.000× "
                     "(≤ 1.1); default and lossless beat none in both: True -> targets NOT met"]
