"""Needle conversations: a fact planted early, real ShareGPT filler turns, then a question about it.
Pure Python (tokenizer only), so peer benchmarks in other environments build the same needles."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from statekeeper.chat import ChatFormatter

_NEEDLE_KINDS = [
    ("locker code", lambda r: f"{r.randint(1000, 9999)}"),
    ("wifi password", lambda r: r.choice(["bluefalcon", "maplestar", "tigerlily", "sunnyriver"]) + str(r.randint(10, 99))),
    ("sister's name", lambda r: r.choice(["Margaret", "Beatrice", "Yolanda", "Priscilla", "Genevieve", "Rosalind"])),
    ("car's colour", lambda r: r.choice(["burgundy", "turquoise", "mustard yellow", "olive green", "lavender"])),
    ("hotel", lambda r: r.choice(["the Grand Budapest", "the Blue Lagoon Inn", "the Amber Palace", "the Cedar Lodge"])),
    ("dog's name", lambda r: r.choice(["Biscuit", "Pepper", "Rocket", "Waffles", "Noodle"])),
    ("meeting room", lambda r: f"room {r.randint(100, 999)}"),
    ("home town", lambda r: r.choice(["Lisbon", "Krakow", "Nairobi", "Valparaiso", "Osaka", "Tallinn"])),
]


@dataclass(slots=True)
class Needle:
    history: list[dict]  # plant, restatement, filler turns
    question: str
    answer_prefix: str
    fact: str
    kind: str = field(default="")


def make_needles(count: int, filler: list[list[tuple[str, str]]], formatter: ChatFormatter, target_tokens: int,
                 seed: int = 0) -> list[Needle]:
    """Needle conversations: a fact is planted and restated in the first turn (the model is small: it
    recalls facts its own turn repeated far better), real ShareGPT exchanges follow until the history
    reaches about `target_tokens`, then the question, answered after a prefix like "You told me that your locker code is"."""
    rng = random.Random(seed)
    needles = []
    fillers = iter(filler)
    while len(needles) < count:
        kind, value_of = _NEEDLE_KINDS[len(needles) % len(_NEEDLE_KINDS)]
        fact = value_of(rng)
        history = [
            {"role": "user", "content": f"Please remember this for later: my {kind} is {fact}."},
            {"role": "assistant", "content": f"Got it. Your {kind} is {fact}. I will remember it."},
        ]
        conversation = next(fillers, None)
        if conversation is None:
            raise ValueError(f"ran out of filler conversations after {len(needles)} needles of ~{target_tokens} tokens")
        for user, assistant in zip(conversation[::2], conversation[1::2]):
            if len(formatter.encode(formatter.render(history, False))) >= target_tokens:
                break
            history += [{"role": "user", "content": user[1]}, {"role": "assistant", "content": assistant[1]}]
        length = len(formatter.encode(formatter.render(history, False)))
        if 0.8 * target_tokens <= length <= 1.3 * target_tokens:
            question = f"Earlier I told you my {kind}. What is my {kind}?"
            needles.append(Needle(history, question, f"You told me that your {kind} is", fact, kind))
    return needles
