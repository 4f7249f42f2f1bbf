"""Where the session service's work runs, and the bridge to it from the event loop: model calls on the model
lanes (scheduler/lanes.py: the model thread, and the long lane where there is one), history and tier calls on
I/O threads, a returning user's read of stored KV on restore threads of its own (so it never waits behind
offload writes and compaction)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import anyio

from scheduler.batch import BatchLimits
from scheduler.lanes import ModelLanes
from statekeeper.history import HistoryUnavailable, is_out_of_space
from statekeeper.kv_cache import KVCache
from statekeeper.sessions.errors import as_refusal
from statekeeper.threads import use_threads
from statekeeper.worker import ModelWorker
from storage import serialization

T = TypeVar("T")
LEASE_THREADS = 4
TEMPLATE_THREADS = 2  # a turn's rendering need not wait for a whole preparation's


class Executors:
    def __init__(self, run_step: Callable, limits: BatchLimits, model_threads: int, long_lane: bool):
        """`run_step` is the batched forward (on the model lanes); `model_threads` is TORCH_THREADS, the model
        lanes' alone (statekeeper/threads.py): every other thread runs torch with one, threads born later too."""
        self.lanes = ModelLanes(run_step, limits, partial(use_threads, model_threads), long_lane)
        use_threads(1)
        self.io = ThreadPoolExecutor(2, thread_name_prefix="statekeeper-io", initializer=use_threads, initargs=(1,))
        self.restore = ThreadPoolExecutor(2, thread_name_prefix="statekeeper-restore", initializer=use_threads,
                                          initargs=(1,))
        # The turns' leases across replicas (statekeeper/coordination.py), on threads of their own: a renewal
        # in line behind seconds of blob writes on the I/O threads let the lease expire under its turn. A few:
        # against a Redis that does not answer each call waits its socket timeout, and one thread made every
        # turn's acquire and release wait for all the others'.
        self.leases = ThreadPoolExecutor(LEASE_THREADS, thread_name_prefix="statekeeper-lease")
        # Chat-template renderings and encodings of whole histories (tens to hundreds of ms for a long one): off
        # the event loop, where every other user's stream waits, and never in line behind blob writes; a turn's
        # own never in line behind the next turns' preparations either (their renderings have a thread apart).
        self.templates = ThreadPoolExecutor(TEMPLATE_THREADS, thread_name_prefix="statekeeper-template",
                                            initializer=use_threads, initargs=(1,))
        self.preparation_templates = ThreadPoolExecutor(1, thread_name_prefix="statekeeper-template-background",
                                                        initializer=use_threads, initargs=(1,))

    @property
    def model_thread(self):
        return self.lanes.main

    @property
    def background_lanes(self) -> int:
        """How many model lanes take background jobs at once: the model thread, and the long lane where there
        is one (it runs them, as its own prompts, at a lower priority than the model thread's work)."""
        return 1 if self.lanes.long is None else 2

    @property
    def last_background_lane(self) -> int:
        """The long lane where there is one, else the model thread: where preparations run by default."""
        return self.background_lanes - 1

    def background_lane(self, lane: int):
        """Background lane `lane`'s thread (0: the model thread; 1: the long lane, where there is one)."""
        return self.lanes.long if lane == 1 and self.lanes.long is not None else self.lanes.main

    async def in_model_thread(self, fn, *args, background: bool = False, waits: list[float] | None = None,
                              tokens: int = 0, lane: int = 0):
        """`waits`, if given, gets the seconds the job waited in line for the model thread; `tokens`, the
        tokens a live job runs, picks its lane (scheduler/lanes.py); a background job runs on background lane
        `lane` (0: the model thread; 1: the long lane, where there is one; see background_lanes)."""
        if background:
            job = self.background_lane(lane).submit_background(fn, *args)
        else:
            job = self.lanes.for_tokens(tokens).submit(fn, *args)
        return await _finished(job, waits, job.cancel)  # cancelled while in line, it never runs

    async def in_step(self, stream, payload, tokens: list[int], waits: list[float] | None = None):
        """Appends `tokens` to the KV in `payload` in batched steps with other turns'; the step's result for
        the last one. `stream` names the turn (None: a one-off job the next step need not wait for); `waits`,
        if given, gets the seconds the job waited in line before its first step."""
        lane = self.lanes.for_tokens(len(tokens))
        job = lane.submit_step(stream, payload, tokens)
        return await _finished(job.future, waits, lambda: lane.abandon(job))

    def end_stream(self, stream) -> None:
        """The turn sends no more steps: the next step need not wait for it."""
        self.lanes.main.end_stream(stream)

    async def in_io_thread(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)
        except HistoryUnavailable as exc:  # a read or write of a history database that is down: 503
            raise as_refusal(exc) from exc
        except Exception as exc:  # a write the history had no room for (its map, its disk): 507, not a 500
            if is_out_of_space(exc):
                raise as_refusal(exc) from exc
            raise

    async def in_template_thread(self, fn, *args, background: bool = False):
        """`background`: a rendering for work no request waits on (the next turn's preparation)."""
        pool = self.preparation_templates if background else self.templates
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def in_restore_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.restore, fn, *args)

    async def warm_up(self, worker: ModelWorker) -> None:
        """Runs the restore path once on every thread, so the first user does not pay for lazy initialisation
        (kernel selection, thread pools: over 100 ms for the first restore on CPU)."""
        cache = worker.new_cache()
        tokens = worker.tokenizer("warm up", add_special_tokens=False)["input_ids"]
        await self.in_model_thread(worker.prefill, cache, tokens)
        blob = serialization.encode(cache.export_layers(), worker.fingerprint, tokens)

        def restore_once():
            _, layers = serialization.decode(blob, worker.fingerprint, tokens)
            KVCache.from_layers(layers, worker.device)

        await asyncio.gather(*(self.in_io_thread(restore_once) for _ in range(self.io._max_workers)),
                             *(self.in_restore_thread(restore_once) for _ in range(self.restore._max_workers)))

    def stats(self) -> dict:
        """The model thread's and the long lane's counters (the admin API's `model_thread` and
        `long_prefill_lane`)."""
        main, long = self.lanes.main, self.lanes.long
        queued, waited = main.depth(), main.waited()
        return {
            "model_thread": main.busy() | {
                "live_queued": queued["live"], "background_queued": queued["background"],
                "live_wait_seconds": round(waited["live"], 6),
                "background_wait_seconds": round(waited["background"], 6)} | {
                f"batch_{name}": count for name, count in main.batching().items()},
            "long_prefill_lane": None if long is None else long.busy() | {
                "live_queued": long.depth()["live"], "live_wait_seconds": round(long.waited()["live"], 6)},
        }

    def close(self) -> None:
        self.lanes.shutdown()
        self.io.shutdown(wait=True)
        self.restore.shutdown(wait=True)
        self.leases.shutdown(wait=True)
        self.templates.shutdown(wait=True)
        self.preparation_templates.shutdown(wait=True)

    async def in_lease_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.leases, fn, *args)


async def _finished(job: Future, waits: list[float] | None, abandon=lambda: None):
    """The result of a model-thread job; `waits`, if given, gets the seconds it waited in line. Cancelled,
    the caller still waits for the job to end (after `abandon()` asks it to stop early), through every further
    cancel (uvicorn's, at each await): a cancelled turn must not roll back the KV while a forward is still
    writing into it."""
    future = asyncio.wrap_future(job)
    try:
        result = await asyncio.shield(future)
    except asyncio.CancelledError:
        abandon()
        with contextlib.suppress(BaseException):  # a job abandoned before it started ends cancelled
            await to_the_end(future)
        raise
    if waits is not None:
        waits.append(job.queued_seconds)
    return result


async def to_the_end(awaitable: Awaitable[T]) -> T:
    """`awaitable` run to its end even where the caller is cancelled meanwhile, then that cancellation raised:
    cleanup that must happen (a conversation whose client never learnt its id deleted, a lease given back).
    A client's disconnect under uvicorn cancels the request's task again at each of its awaits (anyio's cancel
    scope), so a plain `finally` got no further than its first await."""
    task = asyncio.ensure_future(awaitable)
    cancelled = False
    # Shielded from anyio's cancel scope, which cancels the task again at each turn of the event loop: waiting
    # through that was a busy loop that starved the model thread of the GIL (a forward of 0.1 s took 12).
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:  # a plain cancel of the task (asyncio's own), once
                if task.cancelled():  # the work itself was cancelled (the loop shutting down)
                    raise
                cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return task.result()
