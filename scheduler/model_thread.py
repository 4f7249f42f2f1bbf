"""The single thread that runs every model call, with two priorities: live work (a turn's prefill and
decode steps, restores) always goes before background work (compression scoring at offload), which is
submitted one chunk at a time so a live turn waits for at most one chunk. Plain Python, no torch."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from concurrent.futures import Executor, Future

LIVE, BACKGROUND, STOP = 0, 1, 2


class ModelThread(Executor):
    def __init__(self, name: str = "statekeeper-model"):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO within a priority
        self._closed = False
        # Seconds spent and jobs run per priority (LIVE, BACKGROUND): where the model thread's time went.
        self._busy_seconds = [0.0, 0.0]
        self._jobs = [0, 0]
        # Jobs in line and the seconds jobs waited there, per priority: a slow first token is either
        # queueing behind other work or compute, and only these tell which.
        self._queued = [0, 0]
        self._waited_seconds = [0.0, 0.0]
        self._counting = threading.Lock()  # submitters and the model thread both change `_queued`
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self._put(LIVE, fn, args, kwargs)

    def submit_background(self, fn, /, *args, **kwargs) -> Future:
        return self._put(BACKGROUND, fn, args, kwargs)

    def _put(self, priority: int, fn, args, kwargs) -> Future:
        if self._closed:
            raise RuntimeError("the model thread is shut down")
        future: Future = Future()
        future.queued_seconds = None  # how long it waited in line, once it started (a turn reports it)
        future.submitted = time.perf_counter()
        with self._counting:
            self._queued[priority] += 1
        self._queue.put((priority, next(self._order), future, fn, args, kwargs))
        return future

    def _run(self) -> None:
        while True:
            priority, _, future, fn, args, kwargs = self._queue.get()
            if priority == STOP:
                return
            with self._counting:
                self._queued[priority] -= 1
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            future.queued_seconds = started - future.submitted
            self._waited_seconds[priority] += future.queued_seconds
            try:
                result, error = fn(*args, **kwargs), None
            except BaseException as exc:  # delivered to the awaiting caller
                result, error = None, exc
            self._busy_seconds[priority] += time.perf_counter() - started
            self._jobs[priority] += 1
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def busy(self) -> dict:
        """Time the thread spent on live work (turns, restores) and on background work (compression)."""
        return {"live_seconds": round(self._busy_seconds[LIVE], 3),
                "background_seconds": round(self._busy_seconds[BACKGROUND], 3),
                "live_jobs": self._jobs[LIVE], "background_jobs": self._jobs[BACKGROUND]}

    def depth(self) -> dict:
        """Jobs waiting in line now, per priority (a cancelled one counts until the thread reaches it)."""
        with self._counting:
            return {"live": self._queued[LIVE], "background": self._queued[BACKGROUND]}

    def waited(self) -> dict:
        """Seconds that the jobs run so far waited in line before they started, per priority."""
        return {"live": self._waited_seconds[LIVE], "background": self._waited_seconds[BACKGROUND]}

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put((STOP, next(self._order), None, None, None, None))  # after everything queued
        if wait:
            self._thread.join()
