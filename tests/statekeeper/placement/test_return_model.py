"""The return-gap model: a heavy-tailed prior that orders as LRU does, then what the traffic shows."""

import pytest

from statekeeper.placement.return_model import (GAP_EDGES_S, PRIOR_EXPOSURE_S, PRIOR_OFFSET_S, ReturnGapModel,
                                                prior_hazard)


def test_a_fresh_model_falls_back_to_the_prior_whose_hazard_falls_with_idle_time():
    model = ReturnGapModel()
    hazards = model.hazards("t", 1, now=0.0)  # per gap bin
    assert hazards == sorted(hazards, reverse=True) and hazards[0] > hazards[-1]
    # Over whole bins the binned prior integrates 1 / (t + offset) exactly: P = 1 - offset / (offset + within).
    within = GAP_EDGES_S[8]
    assert model.return_probability("t", 1, 0.0, within, now=0.0) == pytest.approx(
        1 - PRIOR_OFFSET_S / (PRIOR_OFFSET_S + within), rel=1e-12)


def test_returns_and_idle_time_that_never_ended_in_a_return_both_count():
    """100 conversations go idle at 0; 50 come back after 20 s, 50 never (still away at 100 s). The 15-30 s
    bin saw 50 returns over 50 x 5 s + 50 x 15 s of idle time; the 30-60 s bin none over 50 x 30 s."""
    model = ReturnGapModel()
    for _ in range(100):
        model.went_idle("t", 1, when=0.0)
    for _ in range(50):
        model.came_back("t", 1, idle_since=0.0, now=20.0)
    everyone = model.table(now=100.0)["all"]
    prior = prior_hazard()
    # The open idle periods are counted from the middle of their start's minute (30 s here), so at 100 s
    # they have been away 70 s.
    assert everyone[1] == pytest.approx((50 + PRIOR_EXPOSURE_S * prior[1]) / (50 * 5 + 50 * 15 + PRIOR_EXPOSURE_S))
    assert everyone[2] == pytest.approx(PRIOR_EXPOSURE_S * prior[2] / (50 * 30 + PRIOR_EXPOSURE_S))
    assert everyone[1] > prior[1] and everyone[2] < prior[2]


def test_a_tenant_learns_its_own_gaps_and_an_unseen_one_uses_everyones():
    model = ReturnGapModel()
    now = 0.0
    for number in range(2_000):  # quick users: back after 20 s, every time
        model.went_idle("agent", 1, now)
        model.came_back("agent", 1, now, now + 20.0)
        now += 1.0
    soon = model.return_probability("agent", 1, 0.0, 60.0, now)
    later = model.return_probability("agent", 1, 600.0, 3_600.0, now)
    assert soon > 0.9 and later < soon
    assert list(model.hazards("stranger", 1, now)) == model.table(now)["all"]  # everyone's: all of it the agent's
    assert model.return_probability("stranger", 1, 0.0, 60.0, now) > 0.75 > prior_probability(60.0)


def prior_probability(within: float) -> float:
    return 1 - PRIOR_OFFSET_S / (PRIOR_OFFSET_S + within)


def test_idle_periods_older_than_the_last_bin_are_summed_not_kept_by_the_minute():
    """Two models see the same 1,000 conversations go idle over a week, half coming back after four days (past
    the last bin's start): one refreshed every hour (folding old minutes into sums, so those returns close
    periods already summed), one only at the end. Same hazards; bounded slots."""
    folded, unfolded = ReturnGapModel(), ReturnGapModel()
    week = 7 * 86_400.0
    for model in (folded, unfolded):
        for number in range(1_000):
            started = number * week / 1_000
            model.went_idle("t", 1, started)
    events = []
    for number in range(0, 1_000, 2):
        started = number * week / 1_000
        if started + 4 * 86_400.0 < week:
            events.append((started + 4 * 86_400.0, started))
    hour = 0.0
    for back, started in sorted(events):
        while hour <= back:
            folded.refresh(hour)
            hour += 3_600.0
        for model in (folded, unfolded):
            model.came_back("t", 1, started, back)
    assert folded.table(week)["all"] == pytest.approx(unfolded.table(week)["all"], rel=1e-9)
    assert folded.slots_held() <= 3 * (GAP_EDGES_S[-1] / 60 + 2)  # three levels
