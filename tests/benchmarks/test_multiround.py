"""benchmarks/multiround.py's runs and report, with a fake service (tests/benchmarks/fakes.py) in place of the real one."""

import json

import pytest

from benchmarks import multiround
from tests.benchmarks.fakes import FakeService, turn

USERS = [["hello", "again"], ["hi", "more"]]


@pytest.fixture
def fake_service(monkeypatch):
    """multiround.main with the fake service, two users of two rounds, and a replay whose every turn succeeds."""
    FakeService.starts = []
    monkeypatch.setattr(multiround, "ServiceProcess", FakeService)
    monkeypatch.setattr(multiround, "pick_users", lambda *args: USERS)

    async def replay(url, schedule, config, args, admin_token):
        turns = [turn(user, round_) for user, messages in enumerate(USERS) for round_ in range(len(messages))]
        return {"wall_s": 10.0, "turns": turns, "polls": [], "admin": {}}

    monkeypatch.setattr(multiround, "replay", replay)
    return FakeService


def test_every_timed_start_reads_measurements_an_untimed_start_made(fake_service, tmp_path):
    multiround.main(["--configs", "default,lossless,none", "--repeats", "2", "--json", str(tmp_path / "out.json")])
    measuring = [start for start in fake_service.starts if start["measured"]]
    assert len(measuring) == 1 and fake_service.starts[0]["measured"]  # the one untimed start, before the others
    assert len(fake_service.starts) == 7 and len(json.loads((tmp_path / "out.json").read_text())["runs"]) == 6
