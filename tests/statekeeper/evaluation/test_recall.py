import random

import pytest

from statekeeper.chat import ChatFormatter
from statekeeper.evaluation.recall import ask, make_recall_cases, plant_facts
from benchmarks.harness.tiny_model import build_tokenizer

FILLER = [[("user", "Tell me about the history of Rome."), ("assistant", "Rome was not built in a day. " * 3)] * 8]


@pytest.fixture(scope="module")
def formatter():
    return ChatFormatter(build_tokenizer())


def test_planted_facts_vary_and_the_answer_restates_the_asked_ones():
    rng = random.Random(0)
    kinds, plants, counts, questions = set(), set(), set(), set()
    for _ in range(60):
        plant, facts = plant_facts(rng, rng.randint(3, 5))
        question, answer, asked = ask(rng, facts)
        assert 3 <= len(facts) <= 5 and len({f.said for f in facts}) == len(facts)
        assert all(f"{f.said} {f.value}" in plant.lower() or f"{f.said[0].upper()}{f.said[1:]} {f.value}" in plant
                   for f in facts)
        assert all(f.value in answer and f.restated in answer.lower() for f in asked) and all(f in facts for f in asked)
        assert all(f.value not in question for f in facts)
        kinds.update(f.said for f in facts)
        plants.add(plant.split(".")[0])
        counts.add(len(asked))
        questions.add(question.split(":")[0])
    assert len(kinds) >= 15 and len(plants) >= 5 and counts == {1, 2} and len(questions) >= 4


def test_recall_cases_are_deterministic_and_reach_the_target_length(formatter):
    cases = make_recall_cases(3, iter(FILLER * 3), formatter, target_tokens=400, seed=7)
    assert cases == make_recall_cases(3, iter(FILLER * 3), formatter, target_tokens=400, seed=7)
    assert cases != make_recall_cases(3, iter(FILLER * 3), formatter, target_tokens=400, seed=8)
    for case in cases:
        length = len(formatter.encode(formatter.render(case.history, False)))
        assert 320 <= length <= 520 and len(case.history) >= 6  # the planting exchange and >= 2 filler ones
        assert all(fact.value in case.history[0]["content"] and fact.value in case.answer for fact in case.asked)
        assert all(fact.value not in case.history[1]["content"] for fact in case.asked)  # not repeated back
    with pytest.raises(ValueError, match="ran out of filler"):
        make_recall_cases(5, iter(FILLER * 2), formatter, target_tokens=400)
