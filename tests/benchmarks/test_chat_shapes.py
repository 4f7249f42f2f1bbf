"""benchmarks/chat_shapes.py's summaries over repeats: turns pooled, each repeat's ratios to the control."""

from benchmarks.chat_shapes import summaries_over_repeats, table


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
