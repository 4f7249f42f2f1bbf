"""Iteration-level batching (Orca's continuous batching, planned as nano-vllm does: plain Python over
lists). A turn hands the model thread step jobs: "append these tokens to my KV, give me the logits after
the last one" — one token while decoding, the whole new message for a prefill. Every step, all decoding
turns advance together and prefills ride along a chunk at a time, so a long prefill neither stalls the
decoders for all of its length nor waits behind all of their replies. Turns join and leave between steps.

A prefill is cut at fixed multiples of the chunk size from its own start, whatever else shares the step:
its chunking, and so its arithmetic, does not depend on the batch it rides in."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field


class StepAbandoned(Exception):
    """The turn that owned a step job went away between steps; what it had appended stays in its KV, which
    the turn rolls back."""


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_sessions: int = 16  # conversations in one step; 1 runs every conversation's step alone
    prefill_tokens: int = 512  # prefill tokens per step (whole chunks; at least one chunk always rides)
    chunk_tokens: int = 512  # a prefill's chunk: cut at multiples of this from the prefill's start
    gather_seconds: float = 0.005  # how long a step waits for the turns of the last one to send their next token
    # A step's cost that does not grow with its tokens (reading the weights, the layers' fixed work), in prefill
    # tokens' worth: the hardware profile's fixed_ms / linear_ms, measured on the machine (0: not known).
    step_overhead_tokens: float = 0.0

    def __post_init__(self):
        if self.max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        if self.chunk_tokens < 1 or self.prefill_tokens < 1:
            raise ValueError("chunk_tokens and prefill_tokens must be >= 1")
        if self.gather_seconds < 0 or self.step_overhead_tokens < 0:
            raise ValueError("gather_seconds and step_overhead_tokens must be >= 0")


@dataclass(eq=False, slots=True)
class StepJob:
    stream: object  # the turn it belongs to: the scheduler waits briefly for a stream's next job
    payload: object  # what the model runner needs besides the tokens (the session's cache and statistics)
    tokens: list[int]
    future: Future = field(default_factory=Future)
    fed: int = 0  # tokens already run
    submitted: float = field(default_factory=time.perf_counter)
    abandoned: bool = False  # its turn went away: it ends at the next step boundary

    @property
    def is_decode(self) -> bool:
        return len(self.tokens) == 1

    def next_chunk(self, chunk_tokens: int) -> list[int]:
        end = min(len(self.tokens), (self.fed // chunk_tokens + 1) * chunk_tokens)
        return self.tokens[self.fed : end]


def plan_step(pending: list[StepJob], limits: BatchLimits) -> list[tuple[StepJob, list[int]]]:
    """The jobs that ride the next step (`pending` is oldest first) and the tokens each one runs: decodes
    first, one token each, then prefill chunks, the prefill with the fewest tokens left first (oldest first
    among equals), while they fit the step's prefill tokens (the first chunk always does); at most
    max_sessions jobs, one slot kept for a prefill so that decoders never starve it. Fewest tokens first
    minimises the time to first token: a returning user's short message does not wait for all of a new
    conversation's long first prompt, only for the step under way.

    A chunk that ends its prompt rides with no prefill that does not end in the step: its user's first token
    is due. Another prompt that ends in the step joins it only where that lowers the users' summed time to
    first token: it delays the m prompts already in the step by its own tokens' cost and saves itself a
    step's fixed cost, so it joins while m x its tokens < step_overhead_tokens (a burst of short prompts
    shares steps; a long one does not hold a short one back). Decodes, which cost by the weights read, share
    every step. With max_sessions 1, the oldest job alone: every turn runs as if alone."""
    if not pending:
        return []
    if limits.max_sessions == 1:
        job = pending[0]
        return [(job, job.next_chunk(limits.chunk_tokens))]
    prefills = sorted((job for job in pending if not job.is_decode), key=lambda job: len(job.tokens) - job.fed)
    decode_slots = limits.max_sessions - (1 if prefills else 0)
    chosen = [(job, job.tokens) for job in pending if job.is_decode][:decode_slots]
    room = limits.prefill_tokens
    ending = 0  # prompts chosen that end in this step
    for job in prefills:
        chunk = job.next_chunk(limits.chunk_tokens)
        if len(chosen) >= limits.max_sessions or (len(chunk) > room and room < limits.prefill_tokens):
            break
        ends = job.fed + len(chunk) == len(job.tokens)
        if ending and not (ends and ending * len(chunk) < limits.step_overhead_tokens):
            break
        chosen.append((job, chunk))
        room -= len(chunk)
        ending += ends
        if room <= 0:
            break
    return chosen
