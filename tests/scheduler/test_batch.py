import pytest

from scheduler.batch import BatchLimits, StepJob, plan_step


def job(name, tokens, fed=0):
    return StepJob(stream=name, payload=name, tokens=list(range(tokens)), fed=fed)


def planned(pending, **limits):
    return [(j.stream, len(tokens)) for j, tokens in plan_step(pending, BatchLimits(**limits))]


def test_decodes_ride_first_then_the_prefill_with_the_fewest_tokens_left():
    pending = [job("p1", 300), job("d1", 1), job("p2", 100), job("d2", 1), job("p3", 50), job("p4", 50)]
    assert planned(pending, chunk_tokens=128, prefill_tokens=256) == [("d1", 1), ("d2", 1), ("p3", 50)]
    assert planned([job("long", 300, fed=256), job("short", 60)], chunk_tokens=128, prefill_tokens=64) == [("long", 44)]


def test_a_prompt_that_ends_in_the_step_rides_without_another_turns_prefill():
    """A returning user's 50-token message rode beside the last 460 tokens of a new conversation's prompt
    and waited for all of them (744 ms for its first token at 8 users): prefill costs by the token, so
    sharing the step saved nothing and only delayed the one whose first token was due."""
    pending = [job("new", 972, fed=512), job("back", 50)]
    assert planned(pending, chunk_tokens=512, prefill_tokens=512) == [("back", 50)]
    assert planned(pending[:1], chunk_tokens=512, prefill_tokens=512) == [("new", 460)]


def test_short_prompts_that_end_in_the_step_share_it_while_that_saves_more_than_it_delays():
    """A burst of short prompts (8 clients arriving at once) ran a step each: the last one's first token
    waited for 7 steps' fixed cost. Each joins while m x its tokens < the step's fixed cost in tokens (m
    prompts already in the step), which lowers the summed time to first token."""
    burst = [job(f"p{i}", 40) for i in range(5)]
    assert planned(burst, chunk_tokens=512, prefill_tokens=512) == [("p0", 40)]  # fixed cost not known
    assert planned(burst, chunk_tokens=512, prefill_tokens=512, step_overhead_tokens=100) == [
        ("p0", 40), ("p1", 40), ("p2", 40)]  # 1 x 40 and 2 x 40 < 100; 3 x 40 is not
    # A long prompt's last chunk still does not hold a short one back, nor a prompt that does not end.
    assert planned([job("new", 972, fed=512), job("back", 50)], chunk_tokens=512, prefill_tokens=512,
                   step_overhead_tokens=100) == [("back", 50)]
    assert planned([job("short", 30), job("long", 900)], chunk_tokens=128, prefill_tokens=512,
                   step_overhead_tokens=1000) == [("short", 30)]


def test_prompts_that_do_not_end_in_the_step_share_the_prefill_tokens():
    pending = [job("a", 1000), job("b", 900, fed=128), job("c", 2000)]
    assert planned(pending, chunk_tokens=128, prefill_tokens=256) == [("b", 128), ("a", 128)]


def test_a_prefill_is_cut_at_multiples_of_the_chunk_from_its_own_start_whatever_rides_with_it():
    long = job("p", 300, fed=128)
    assert planned([long], chunk_tokens=128, prefill_tokens=512) == [("p", 128)]
    long.fed = 256
    assert planned([job("d", 1), long], chunk_tokens=128, prefill_tokens=512) == [("d", 1), ("p", 44)]


def test_the_first_chunk_always_rides_and_a_chunk_that_does_not_fit_waits_for_the_next_step():
    assert planned([job("big", 600)], chunk_tokens=512, prefill_tokens=100) == [("big", 512)]
    assert planned([job("a", 60), job("big", 600), job("small", 50)], chunk_tokens=512, prefill_tokens=100) == [
        ("small", 50)]


def test_decoders_never_take_the_last_slot_from_a_waiting_prefill():
    pending = [job(f"d{i}", 1) for i in range(5)] + [job("p", 40)]
    assert planned(pending, max_sessions=4) == [("d0", 1), ("d1", 1), ("d2", 1), ("p", 40)]
    assert planned(pending[:5], max_sessions=4) == [("d0", 1), ("d1", 1), ("d2", 1), ("d3", 1)]


def test_one_session_per_step_runs_the_oldest_job_alone():
    pending = [job("p", 300, fed=128), job("d", 1)]
    assert planned(pending, max_sessions=1, chunk_tokens=128) == [("p", 128)]
    assert planned([], max_sessions=1) == []


@pytest.mark.parametrize("limits", [{"max_sessions": 0}, {"chunk_tokens": 0}, {"prefill_tokens": 0}, {"gather_seconds": -1}])
def test_limits_that_cannot_work_are_refused(limits):
    with pytest.raises(ValueError):
        BatchLimits(**limits)
