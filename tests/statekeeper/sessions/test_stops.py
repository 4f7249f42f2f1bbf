"""Stop strings in a reply (statekeeper/sessions/turns.py's StopStrings): where one begins, and how much of
the end of the text is held back from the stream because it could still become one. Checked against the
plain definitions on random texts."""

import random

import pytest

from statekeeper.sessions.turns import StopStrings


def first_stop(text, stops):
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found, default=None)


def held_back(text, stops):
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@pytest.mark.parametrize("seed", range(20))
def test_the_first_stop_and_the_held_back_tail_are_those_of_the_definitions(seed):
    rng = random.Random(seed)
    alphabet = "ab\u00e9 "
    stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4)))
    matcher = StopStrings(stops)
    text = ""
    while len(text) < 60:
        text += "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))  # a token's worth
        cut = matcher.first(text)
        assert cut == first_stop(text, stops), (text, stops)
        if cut is not None:
            break
        assert matcher.held_back(text) == held_back(text, stops), (text, stops)


def test_a_long_stop_string_of_one_repeated_letter():
    stop = "a" * 255 + "b"
    matcher = StopStrings((stop,))
    assert matcher.held_back("a" * 2000) == 255 and matcher.first("a" * 2000) is None
    assert matcher.held_back("a" * 100) == 100 and matcher.first("a" * 300 + "b") == 45


def test_no_stop_strings():
    matcher = StopStrings(())
    assert matcher.first("anything") is None and matcher.held_back("anything") == 0
