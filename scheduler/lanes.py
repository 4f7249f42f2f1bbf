"""Which model thread a job runs on. One thread runs every model call in turn (scheduler/model_thread.py), so a
job's cost is every other user's wait: a chunk of a prompt at the context limit holds the step that carries
the others' first tokens for as long as it takes (a 512-token chunk at 7k tokens of context: ~1.5 s on one
core of a Xeon, BENCHMARKS.md issue 28), whatever the chunking, since attention over that context costs by
the context. Where the CPU has a core the model thread does not use, prompts longer than one chunk (and
scorings as long) run on a second model thread there: the long lane; a shorter prompt does too when the
long lane has less live work in hand than the model thread (its background jobs give way to it). Decodes,
restores and background compression stay on the model thread. A conversation's arithmetic is the same on
either (a segment's results do not depend on what else rides its forward: BENCHMARKS.md "Batch
invariance"), so the lane changes when a token comes, never which."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable

from scheduler.batch import BatchLimits
from scheduler.model_thread import ModelThread


# The long lane's scheduling priority (nice): above the compression child's (SCHED_IDLE), below the model
# thread, the event loop and the restore threads, whose bursts (a returning user's blob decoding, a stream's
# sends) take the spare core from it at once instead of sharing it.
LONG_LANE_NICE = 10


def lower_priority(nice: int = LONG_LANE_NICE) -> None:
    """Lowers the calling thread's priority (Linux: a thread has a nice value of its own); elsewhere nothing."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


def wants_long_lane(setting: str, device_type: str, threads: int) -> bool:
    """on | off as said; auto: on a CPU with at least two model threads' worth of cores for this process
    (the compression child runs at idle priority and yields to it). A GPU runs one forward at a time anyway."""
    if setting != "auto":
        return setting == "on"
    return device_type == "cpu" and len(os.sched_getaffinity(0)) >= 2 * threads


class ModelLanes:
    def __init__(self, run_step: Callable, limits: BatchLimits, initializer: Callable[[], None], long_lane: bool):
        self.main = ModelThread(run_step, limits, initializer=initializer)
        # Its jobs are prompts, not decoding streams: a step never waits for a stream's next job here.
        self.long = ModelThread(run_step, dataclasses.replace(limits, gather_seconds=0.0),
                                name="statekeeper-long-prefill", initializer=lambda: (initializer(), lower_priority())
                                ) if long_lane else None

    def for_tokens(self, count: int) -> ModelThread:
        """The lane for a live job that runs `count` tokens: the long lane if there is one and they need more than
        one chunk; a shorter prompt there too where the long lane has less live work in hand than the model
        thread (ModelThread.live_backlog: a burst of users' first prompts otherwise ran one after another on the
        model thread, or rode the decoders' steps, with the long lane's core idle: BENCHMARKS.md, "Short prompts
        on the long lane"); else the model thread. Decode steps (one token) stay there, where they share each
        step."""
        if self.long is None or count <= 1:
            return self.main
        if count > self.main.limits.chunk_tokens:
            return self.long
        return self.long if self.long.live_backlog() < self.main.live_backlog() else self.main

    def shutdown(self) -> None:
        for lane in (self.main, self.long):
            if lane is not None:
                lane.shutdown(wait=True)
