"""Traces of conversations for the placement simulator: when each turn comes and how many tokens it adds.
No text: a trace is what the service would log of its own traffic (conversation tags, times, token counts).

`synthetic` draws one: conversations start uniformly over the day; each has a geometric number of turns;
the gap before each later turn is a mixture of a short return (the user reading and typing, lognormal around
a median of SHORT_GAP_MEDIAN_S) and a long one (the user comes back later, lognormal around LONG_GAP_MEDIAN_S
with a wide spread: heavy-tailed), and token counts are lognormal around typical ShareGPT message and reply
lengths. The parameters are assumptions stated here, not fitted to a published trace; the simulator takes
any trace in the same form (a JSON-lines file), so a measured one replaces them."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class TraceTurn:
    time_s: float  # when the turn's request arrives, from the trace's start
    conversation: str
    prompt_tokens: int  # the new message's tokens (with its template's)
    reply_tokens: int


@dataclass(frozen=True, slots=True)
class SyntheticTrace:
    """The synthetic trace's parameters (assumed, see the module's docstring)."""

    conversations: int
    day_s: float = DAY_S
    mean_turns: float = 4.0  # geometric, at least 1
    short_return_share: float = 0.7  # of the gaps before a later turn
    short_gap_median_s: float = 60.0
    short_gap_sigma: float = 0.8  # of the gap's natural log
    long_gap_median_s: float = 3_600.0
    long_gap_sigma: float = 1.5
    prompt_median_tokens: float = 60.0
    prompt_sigma: float = 1.0
    reply_median_tokens: float = 250.0
    reply_sigma: float = 0.7
    seed: int = 0


def synthetic(params: SyntheticTrace) -> list[TraceTurn]:
    """The trace's turns in time order (those past the day's end are dropped)."""
    rng = random.Random(params.seed)
    turns = []
    stop = 1.0 / params.mean_turns  # a geometric number of turns with this mean
    for number in range(params.conversations):
        conversation = f"c{number}"
        time_s = rng.uniform(0.0, params.day_s)
        while time_s < params.day_s:
            turns.append(TraceTurn(time_s, conversation, _tokens(rng, params.prompt_median_tokens, params.prompt_sigma),
                                   _tokens(rng, params.reply_median_tokens, params.reply_sigma)))
            if rng.random() < stop:
                break
            short = rng.random() < params.short_return_share
            median, sigma = ((params.short_gap_median_s, params.short_gap_sigma) if short
                             else (params.long_gap_median_s, params.long_gap_sigma))
            time_s += rng.lognormvariate(math.log(median), sigma)
    turns.sort(key=lambda turn: turn.time_s)
    return turns


def _tokens(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def write(turns: Iterable[TraceTurn], path: Path) -> None:
    with path.open("w") as out:
        for turn in turns:
            out.write(json.dumps(asdict(turn)) + "\n")


def read(path: Path) -> Iterator[TraceTurn]:
    with path.open() as lines:
        for line in lines:
            if line.strip():
                yield TraceTurn(**json.loads(line))
