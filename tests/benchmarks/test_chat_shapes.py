"""benchmarks/chat_shapes.py's summaries over repeats: turns pooled, each repeat's ratios to the control."""

import asyncio
import json

import pytest

from benchmarks import chat_shapes
from benchmarks.chat_shapes import summaries_over_repeats, table
from tests.benchmarks.fakes import FakeService


def _result(template: str, repeat: int, ttfts: list[float], prepared: int = 0) -> dict:
    """One run with one user: a first turn, then a resumed turn per TTFT, each keeping all of the one before."""
    records = [{"status": 200, "prompt_tokens": 100, "completion_tokens": 10, "ttft_ms": 999.0, "sent_s": 0.0,
                "cached_tokens": 0}]
    for ttft in ttfts:
        before = records[-1]
        records.append({"status": 200, "prompt_tokens": before["prompt_tokens"] + 20, "completion_tokens": 10,
                        "ttft_ms": ttft, "sent_s": before["sent_s"] + 1,
                        "cached_tokens": before["prompt_tokens"] + before["completion_tokens"]})
    return {"code": "new", "template": template, "wall_s": 10.0, "users": [records],
            "next_turn": {"prepared": prepared, "abandoned": 1, "tokens": 10 * prepared, "seconds": 0.5},
            "midnight_s": None, "repeat": repeat}


def test_each_template_is_summarized_over_all_its_repeats_with_each_repeats_ratios_beside():
    results = [_result("control", 0, [100, 200]), _result("system-last", 0, [150, 300], prepared=2),
               _result("control", 1, [100, 400]), _result("system-last", 1, [100, 400], prepared=3)]
    control, system_last = summaries_over_repeats(results)
    assert (control["template"], system_last["template"]) == ("control", "system-last")
    assert system_last["resumed_turns"] == 4 and system_last["repeats"] == 2  # both repeats' turns
    assert system_last["next_turn"] == {"prepared": 5, "abandoned": 2, "tokens": 50, "seconds": 1.0}
    assert system_last["share_median"] == 1.0
    first, second = system_last["repeat_ratios"]
    assert first[0] == 225 / 150 and second == (1.0, 1.0)  # p50 of (150, 300) over p50 of (100, 200)
    assert control["repeat_ratios"] == [(1.0, 1.0), (1.0, 1.0)]
    assert "1.50× / " in table([control, system_last])


def _with_choices(result: dict, gemm_rows: int) -> dict:
    return result | {"choices": {"kv_dtype": "bfloat16", "gemm": "bfloat16", "gemm_rows": gemm_rows}}


def test_no_ratio_to_a_control_that_ran_another_gemm():
    results = [_with_choices(_result("control", 0, [100, 200]), 16),
               _with_choices(_result("system-last", 0, [150, 300]), 48)]
    control, system_last = summaries_over_repeats(results)
    assert system_last["repeat_ratios"] == []
    assert "not comparable: bfloat16 GEMM from 48 rows vs bfloat16 GEMM from 16 rows" in table([control, system_last])


@pytest.fixture
def fake_chat_service(monkeypatch, tmp_path):
    """chat_shapes.main with the fake service, a fake model cache, two users of two rounds, every turn served."""
    FakeService.starts, FakeService.measured_in = [], {}
    monkeypatch.setattr(chat_shapes, "ServiceProcess", FakeService)
    monkeypatch.setattr(chat_shapes, "pick_users", lambda *args: [["hello", "again"], ["hi", "more"]])
    model = tmp_path / "models" / "SmolLM2-135M-Instruct-test"
    model.mkdir(parents=True)
    (model / "chat_template.jinja").write_text("{{ messages }}")

    async def replay(url, model_name, schedule, args, admin_token):
        users = [[{"user": t.user, "round": t.round, "status": 200, "ttft_ms": 100.0, "reply": "ok", "restore": {},
                   "prompt_tokens": 10 * (t.round + 1), "completion_tokens": 5, "cached_tokens": 10 * t.round,
                   "reasoning_tokens": 0, "sent_s": float(t.round)} for t in turns] for turns in schedule]
        return 10.0, users, FakeService.admin(url)

    monkeypatch.setattr(chat_shapes, "replay", replay)
    return tmp_path


def test_every_run_reads_the_measurements_of_one_untimed_start(fake_chat_service, tmp_path):
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    chat_shapes.main(["--templates", "control,think-on", "--baseline-repo", str(baseline), "--repeats", "2",
                      "--model-cache", str(tmp_path / "models"), "--json", str(tmp_path / "out.json")])
    assert [start["measured"] for start in FakeService.starts] == [True] + [False] * 8
    runs = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert runs[0]["choices"] == {"kv_dtype": "bfloat16", "gemm": "bfloat16", "gemm_rows": 16}


def test_new_and_baseline_of_other_kernels_are_named_not_comparable():
    new = _with_choices(_result("control", 0, [100, 200]), 16)
    baseline = _with_choices(_result("control", 0, [100, 200]), 48) | {"code": "baseline"}
    assert chat_shapes.code_lines(summaries_over_repeats([new, baseline])) == [
        "control: new/baseline not comparable: bfloat16 GEMM from 16 rows vs bfloat16 GEMM from 48 rows"]


def test_odd_repeats_run_the_set_in_reverse_order(fake_chat_service, tmp_path):
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    chat_shapes.main(["--templates", "control,think-on", "--baseline-repo", str(baseline), "--repeats", "2",
                      "--model-cache", str(tmp_path / "models")])
    ran = [start["data_dir"].name.rsplit("-", 1)[0] for start in FakeService.starts[1:]]
    forward = ["new-control", "baseline-control", "new-think-on", "baseline-think-on"]
    assert ran == forward + forward[::-1]


def test_the_turns_a_failure_left_unsent_are_recorded_as_skipped(monkeypatch):
    async def send_turn(client, model, messages, turn, max_tokens):
        if turn.round == 1:
            return {"user": turn.user, "round": turn.round, "status": 500, "error": "boom"}
        return {"user": turn.user, "round": turn.round, "status": 200, "reply": "ok", "ttft_ms": 100.0,
                "prompt_tokens": 10, "completion_tokens": 5, "cached_tokens": 0, "reasoning_tokens": 0}

    monkeypatch.setattr(chat_shapes, "send_turn", send_turn)
    turns = [chat_shapes.Turn(0, round_, "hi", 0.0, 0.0) for round_ in range(4)]
    records = asyncio.run(chat_shapes.replay_user(None, "model", turns, 8, 0.0))
    assert [(r["round"], r["status"]) for r in records] == [(0, 200), (1, 500), (2, "skipped"), (3, "skipped")]
    summary = chat_shapes.summarize(_result("control", 0, []) | {"users": [records]})
    assert (summary["errors"], summary["skipped"]) == (1, 2)
    assert "| 1 (2 skipped): boom |" in table([summary])
