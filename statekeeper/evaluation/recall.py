"""Recall conversations: an early user message plants several facts (names, numbers, codes, places,
dates), real unrelated ShareGPT turns follow, then the user asks about one or two of the facts and the
assistant's answer restates them. The answer is teacher-forced and scored token by token against the
full KV (statekeeper/evaluation/fidelity.py): what a returning user asks for is exactly this.

Unlike the needles, the assistant does not repeat the facts when they are planted, and every part is
drawn from a seeded generator (which facts, their values, their wording, the question and the answer's
phrasing), so no two conversations share one template. Pure Python (tokenizer only), like needles.py."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from statekeeper.chat import ChatFormatter

_FIRST = ["Margaret", "Tobias", "Ingrid", "Rafael", "Yolanda", "Casimir", "Priya", "Desmond", "Annika", "Lorenzo",
          "Beatrix", "Kwame", "Solveig", "Emeric", "Noor", "Fiona"]
_LAST = ["Okafor", "Lindqvist", "Castellano", "Brennan", "Takahashi", "Duval", "Novak", "Abernathy", "Quintero",
         "Haddad", "Whitlock", "Petrov", "Mbeki", "Ferreira"]
_CITIES = ["Valparaiso", "Tallinn", "Krakow", "Nairobi", "Osaka", "Ljubljana", "Porto", "Hobart", "Tbilisi",
           "Cartagena", "Trondheim", "Marrakesh", "Halifax", "Bruges"]
_STREETS = ["Larkspur", "Juniper", "Harbour View", "Old Mill", "Chestnut", "Foxglove", "Quarry", "Willowbank"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December"]
_WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_CODE_LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"  # no I or O: they read as digits


def _name(r: random.Random) -> str:
    return f"{r.choice(_FIRST)} {r.choice(_LAST)}"


def _code(r: random.Random, length: int) -> str:
    return "".join(r.choice(_CODE_LETTERS + "23456789") for _ in range(length))


def _date(r: random.Random) -> str:
    day, month = r.randint(1, 28), r.choice(_MONTHS)
    return r.choice([f"{day} {month}", f"{month} {day}", f"{r.choice(_WEEKDAYS)}, {month} {day}"])


def _time(r: random.Random) -> str:
    return f"{r.randint(6, 11)}:{r.choice(['05', '15', '20', '35', '40', '50'])} {r.choice(['am', 'pm'])}"


def _person(role: str) -> tuple:
    return (f"my {role} is called", f"what is my {role}'s name", f"your {role} is", _name)


# Each kind of fact: how the user plants it, the question about it, how the answer restates it (all
# followed by the value), and its value's generator. Names, numbers, codes, places, dates and times.
_KINDS: list[tuple[str, str, str, Callable[[random.Random], str]]] = [
    *(_person(role) for role in ("landlord", "new manager", "piano teacher", "dentist", "accountant")),
    ("the budget for the kitchen renovation is", "what is the budget for the kitchen renovation",
     "the budget for the kitchen renovation is", lambda r: f"${r.randint(12, 95) * 100:,}"),
    ("my apartment number is", "what is my apartment number", "your apartment number is",
     lambda r: f"{r.randint(2, 48)}{r.choice('ABCD')}"),
    ("the number of guests we expect at the wedding is", "how many guests do we expect at the wedding",
     "the number of guests you expect at the wedding is", lambda r: f"{r.randint(31, 180)}"),
    ("my flight's booking reference is", "what is my flight's booking reference",
     "your flight's booking reference is", lambda r: _code(r, 6)),
    ("the order number for the replacement laptop is", "what is the order number for the replacement laptop",
     "the order number for the replacement laptop is", lambda r: f"{r.randint(1000000, 9999999)}"),
    ("the gate code for the building is", "what is the gate code for the building",
     "the gate code for the building is", lambda r: f"{r.randint(10, 99)}-{r.randint(10, 99)}-{r.randint(10, 99)}"),
    ("my car's licence plate is", "what is my car's licence plate", "your car's licence plate is",
     lambda r: f"{_code(r, 2)} {r.randint(10, 99)} {_code(r, 3)}"),
    ("the conference this year is in", "where is the conference this year", "the conference this year is in",
     lambda r: r.choice(_CITIES)),
    ("my grandmother grew up in", "where did my grandmother grow up", "your grandmother grew up in",
     lambda r: r.choice(_CITIES)),
    ("the new office is at", "what is the address of the new office", "the new office is at",
     lambda r: f"{r.randint(3, 240)} {r.choice(_STREETS)} {r.choice(['Road', 'Lane', 'Street', 'Avenue'])}"),
    ("my sister's wedding is on", "when is my sister's wedding", "your sister's wedding is on", _date),
    ("the lease on the flat ends on", "when does the lease on the flat end", "the lease on the flat ends on", _date),
    ("my train to the coast leaves at", "what time does my train to the coast leave",
     "your train to the coast leaves at", _time),
]

# Kinds the held-out workload plants instead (fidelity.py's `--heldout`): none of them shaped the defaults,
# which were chosen on the recall cases above. Other values too: phone numbers, emails, amounts in other currencies.
HELDOUT_KINDS: list[tuple[str, str, str, Callable[[random.Random], str]]] = [
    *(_person(role) for role in ("vet", "physiotherapist", "wedding photographer")),
    ("my dog's name is", "what is my dog's name", "your dog's name is", lambda r: r.choice(
        ["Biscuit", "Pepper", "Juniper", "Otis", "Marzipan", "Clementine", "Waffles", "Ziggy"])),
    ("my passport number is", "what is my passport number", "your passport number is",
     lambda r: f"{_code(r, 2)}{r.randint(1000000, 9999999)}"),
    ("the hotel we booked in Lisbon is the", "which hotel did we book in Lisbon", "the hotel you booked in Lisbon is the",
     lambda r: f"{r.choice(['Grand', 'Royal', 'Little', 'Blue', 'Old Town'])} {r.choice(['Harbour', 'Garden', 'Palace', 'Lantern'])}"),
    ("my phone extension at work is", "what is my phone extension at work", "your phone extension at work is",
     lambda r: f"{r.randint(200, 899)}"),
    ("the insurance claim number is", "what is the insurance claim number", "the insurance claim number is",
     lambda r: f"CL-{r.randint(100000, 999999)}"),
    ("my cousin's email address is", "what is my cousin's email address", "your cousin's email address is",
     lambda r: f"{r.choice(_FIRST).lower()}.{r.choice(_LAST).lower()}@{r.choice(['mailbox', 'postbox', 'inbox'])}.org"),
    ("the quote from the roofer was", "how much was the quote from the roofer", "the quote from the roofer was",
     lambda r: f"€{r.randint(18, 240) * 50:,}"),
    ("the book club meets at", "where does the book club meet", "the book club meets at",
     lambda r: f"the {r.choice(['Crooked', 'Silver', 'Red', 'Hollow'])} {r.choice(['Kettle', 'Fern', 'Anchor', 'Oak'])} café"),
    ("my daughter's school play is on", "when is my daughter's school play", "your daughter's school play is on",
     _date),
    ("the dentist appointment is at", "what time is the dentist appointment", "the dentist appointment is at", _time),
    ("the storage unit number is", "what is the storage unit number", "the storage unit number is",
     lambda r: f"{r.choice('ABCDEF')}{r.randint(100, 499)}"),
]

_INTROS = [
    "Before we get into anything else, a few details I'll need later:",
    "Some background you should keep in mind for this conversation.",
    "I'm juggling a lot this month, so please keep track of these for me.",
    "Quick notes first, I will ask about them at some point:",
    "Here is some information about my situation.",
    "Please remember the following.",
]
_OUTROS = ["", " Thanks!", " That's all for now.", " Keep these handy, please.", " I'll come back to them."]
_ACKNOWLEDGEMENTS = [
    "Noted. I'll keep those details in mind.",
    "Got it, I have all of that written down.",
    "Thanks, I've taken note of everything. What would you like to talk about?",
    "Understood. Let me know when you need any of it.",
    "All noted. How can I help you today?",
]
_QUESTIONS_ONE = [
    "Going back to what I told you at the start: {a}?",
    "I forgot, can you remind me: {a}?",
    "Quick question about my notes from earlier. {A}?",
]
_QUESTIONS_TWO = [
    "Can you remind me of two things from the start of our chat: {a}, and {b}?",
    "From what I told you at the beginning: {a}? And {b}?",
    "I need two details from earlier. {A}, and {b}?",
]
_ANSWER_OPENINGS = ["", "Sure. ", "Of course. ", "From what you told me earlier, ", "You mentioned it at the start: "]


@dataclass(slots=True)
class Fact:
    said: str  # "my landlord is called"
    question: str  # "what is my landlord's name"
    restated: str  # "your landlord is"
    value: str


@dataclass(slots=True)
class RecallCase:
    history: list[dict]  # the planting exchange, then the filler turns
    question: str
    answer: str  # teacher-forced: restates the asked facts
    asked: list[Fact]


def plant_facts(rng: random.Random, num_facts: int, kinds: list | None = None) -> tuple[str, list[Fact]]:
    """A user message planting `num_facts` distinct kinds of fact (of `kinds`: the recall set's by default),
    as prose or as a list."""
    kinds = kinds or _KINDS
    chosen = rng.sample(range(len(kinds)), num_facts)
    facts = [Fact(said, question, restated, value_of(rng))
             for said, question, restated, value_of in (kinds[kind] for kind in chosen)]
    sentences = [f"{f.said[0].upper()}{f.said[1:]} {f.value}." for f in facts]
    intro, outro = rng.choice(_INTROS), rng.choice(_OUTROS)
    if rng.random() < 0.5:
        return f"{intro} {' '.join(sentences)}{outro}", facts
    listed = "\n".join(f"- {s}" for s in sentences)
    return f"{intro}\n{listed}" + (f"\n{outro.strip()}" if outro else ""), facts


def ask(rng: random.Random, facts: list[Fact]) -> tuple[str, str, list[Fact]]:
    """The question about one or two of the planted facts, and the answer that restates them."""
    asked = rng.sample(facts, rng.choice([1, 2]))
    clauses = [f.question for f in asked]
    template = rng.choice(_QUESTIONS_ONE if len(asked) == 1 else _QUESTIONS_TWO)
    question = template.format(a=clauses[0], A=clauses[0][0].upper() + clauses[0][1:], b=clauses[-1])
    restated = " and ".join(f"{f.restated} {f.value}" for f in asked) + "."
    opening = rng.choice(_ANSWER_OPENINGS)
    if not opening or opening.endswith(". "):
        restated = restated[0].upper() + restated[1:]
    return question, opening + restated, asked


def make_recall_cases(count: int, filler: Iterable[list[tuple[str, str]]], formatter: ChatFormatter,
                      target_tokens: int, seed: int = 0, min_filler_turns: int = 2, kinds: list | None = None,
                      chain_fillers: bool = False) -> list[RecallCase]:
    """`count` recall conversations whose history (planting exchange and filler) is 0.8-1.3x
    `target_tokens`: each takes the next filler conversation's exchanges until the history reaches the
    target, with at least `min_filler_turns` of them; conversations that over- or undershoot are skipped.
    `chain_fillers`: a case short of the target goes on with the next filler conversations' exchanges (long
    histories, ~4k tokens, that few single ShareGPT conversations reach); `kinds`: the facts it plants."""
    rng = random.Random(seed)
    fillers = iter(filler)
    cases = []
    while len(cases) < count:
        conversation = next(fillers, None)
        if conversation is None:
            raise ValueError(f"ran out of filler conversations after {len(cases)} recall cases "
                             f"of ~{target_tokens} tokens")
        plant, facts = plant_facts(rng, rng.randint(3, 5), kinds)
        question, answer, asked = ask(rng, facts)
        history = [{"role": "user", "content": plant}, {"role": "assistant", "content": rng.choice(_ACKNOWLEDGEMENTS)}]
        num_filler_turns = 0
        while conversation is not None:
            for user, assistant in zip(conversation[::2], conversation[1::2]):
                if len(formatter.encode(formatter.render(history, False))) >= target_tokens:
                    break
                history += [{"role": "user", "content": user[1]}, {"role": "assistant", "content": assistant[1]}]
                num_filler_turns += 1
            short = len(formatter.encode(formatter.render(history, False))) < target_tokens
            conversation = next(fillers, None) if chain_fillers and short else None
        length = len(formatter.encode(formatter.render(history, False)))
        if num_filler_turns >= min_filler_turns and 0.8 * target_tokens <= length <= 1.3 * target_tokens:
            cases.append(RecallCase(history, question, answer, asked))
    return cases
