"""The single thread that runs every model call. Three kinds of work, in this order of priority:
- turns' step jobs (scheduler/batch.py), batched: one forward advances every decoding turn and a chunk of
  a prefill;
- other live jobs (restores, scoring requests, warm-up), one between two steps;
- background jobs (compression scoring, next turns' prefills), only when nothing live waits or is about to:
  they are submitted one chunk at a time, so live work waits for at most one chunk, or for one layer of a
  prefill that gives way (live_waiting).
Plain Python, no torch: `run_step` (the worker's batched forward) is handed in."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future

from scheduler.batch import BatchLimits, StepAbandoned, StepJob, plan_step

LIVE, BACKGROUND = 0, 1


class _Job:
    __slots__ = ("future", "fn", "args", "kwargs")

    def __init__(self, fn, args, kwargs):
        self.future: Future = Future()
        self.future.queued_seconds = None  # how long it waited in line, once it started (a turn reports it)
        self.future.submitted = time.perf_counter()
        self.fn, self.args, self.kwargs = fn, args, kwargs


class ModelThread(Executor):
    def __init__(self, run_step: Callable[[list[tuple[object, list[int]]]], list] | None = None,
                 limits: BatchLimits = BatchLimits(), name: str = "statekeeper-model",
                 initializer: Callable[[], None] | None = None):
        """`initializer` runs first on the thread (the worker's thread count); the constructor returns once
        it has, and raises what it raised."""
        self._run_step = run_step  # [(payload, tokens)] -> one result per entry, the same order
        self.limits = limits
        self._jobs_in_line = (collections.deque(), collections.deque())  # LIVE, BACKGROUND
        self._steps: list[StepJob] = []  # oldest first
        self._expected: set = set()  # streams of the last step that will send their next job soon
        self._last_step_end = 0.0
        self._closed = False
        self._changed = threading.Condition()
        # Seconds spent and jobs run per priority (LIVE, BACKGROUND): where the model thread's time went.
        # Steps count as live work, each finished step job as one job.
        self._busy_seconds = [0.0, 0.0]
        self._jobs = [0, 0]
        # Seconds jobs waited in line, per priority: a slow first token is either queueing behind other
        # work or compute, and only these tell which.
        self._waited_seconds = [0.0, 0.0]
        self._batched = {"steps": 0, "rows": 0, "sessions": 0}
        self._running = False  # a step or a job is under way
        self._running_live_job = False  # ... and it is a live job (not a step: those stay in self._steps)
        self._initializer = initializer
        self._initialized = threading.Event()
        self._initializer_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._initialized.wait()
        if self._initializer_error is not None:
            raise self._initializer_error

    # -- submitting ---------------------------------------------------------------------------------

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self._put(LIVE, fn, args, kwargs)

    def submit_background(self, fn, /, *args, **kwargs) -> Future:
        return self._put(BACKGROUND, fn, args, kwargs)

    def _put(self, priority: int, fn, args, kwargs) -> Future:
        job = _Job(fn, args, kwargs)
        with self._changed:
            self._refuse_if_closed()
            self._jobs_in_line[priority].append(job)
            self._changed.notify()
        return job.future

    def submit_step(self, stream, payload, tokens: list[int]) -> StepJob:
        """Appends `tokens` to the KV in `payload` in as many steps as the batch limits take; the job's
        future gets the result of the step that ran its last token. `stream` names the turn."""
        if not tokens:
            raise ValueError("a step job needs at least one token")
        job = StepJob(stream, payload, list(tokens))
        job.future.queued_seconds = None
        with self._changed:
            self._refuse_if_closed()
            self._steps.append(job)
            self._changed.notify()
        return job

    def abandon(self, job: StepJob) -> None:
        """The job's turn went away: a job not started yet never runs, one under way ends at the next
        step boundary (its future then fails with StepAbandoned)."""
        with self._changed:
            job.abandoned = True
            self._changed.notify()

    def end_stream(self, stream) -> None:
        """The turn sends no more steps: the next step need not wait for it."""
        with self._changed:
            self._expected.discard(stream)
            self._changed.notify()

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise RuntimeError("the model thread is shut down")

    # -- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._initializer is not None:
                self._initializer()
        except BaseException as exc:  # the constructor raises it; the thread ends
            self._initializer_error = exc
            self._closed = True
            return
        finally:
            self._initialized.set()
        while True:
            with self._changed:
                work = self._next_work()
                while work is None:
                    if self._closed and not self._steps and not any(self._jobs_in_line):
                        return
                    self._changed.wait(self._gather_left())
                    work = self._next_work()
                self._running = True  # under the lock: the work has left the line but is not done
                self._running_live_job = not isinstance(work, list) and work[0] == LIVE
            try:
                if isinstance(work, list):
                    self._step(work)
                else:
                    self._job(*work)
            finally:
                self._running = self._running_live_job = False

    def _gather_left(self) -> float | None:
        if not self._expected:
            return None
        return max(0.0, self._last_step_end + self.limits.gather_seconds - time.perf_counter())

    def _next_work(self):
        """Under the lock: a planned step, a (priority, job), or None to wait."""
        self._drop_abandoned()
        if self._expected and self._gather_left() == 0.0:
            self._expected.clear()  # late: the next step goes without them
        missing = self._expected - {job.stream for job in self._steps}
        live, background = self._jobs_in_line
        if live and (missing or not self._steps or self._ran_step_last):
            self._ran_step_last = False
            return LIVE, live.popleft()
        if self._steps and not missing:
            self._ran_step_last = True
            return plan_step(self._steps, self.limits)
        if background and not self._steps and not self._expected:
            return BACKGROUND, background.popleft()
        return None

    _ran_step_last = False  # one live job goes between two steps: neither kind waits for all of the other

    def _drop_abandoned(self) -> None:
        for job in [job for job in self._steps if job.abandoned]:
            self._steps.remove(job)
            if job.fed == 0:
                job.future.cancel()  # never started: its future is still pending
            else:
                job.future.set_exception(StepAbandoned())

    def _job(self, priority: int, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        started = time.perf_counter()
        job.future.queued_seconds = started - job.future.submitted
        self._waited_seconds[priority] += job.future.queued_seconds
        try:
            result, error = job.fn(*job.args, **job.kwargs), None
        except BaseException as exc:  # delivered to the awaiting caller
            result, error = None, exc
        self._busy_seconds[priority] += time.perf_counter() - started
        self._jobs[priority] += 1
        if error is None:
            job.future.set_result(result)
        else:
            job.future.set_exception(error)

    def _step(self, planned: list[tuple[StepJob, list[int]]]) -> None:
        started = time.perf_counter()
        riding = []
        for job, tokens in planned:
            if job.fed == 0:
                if not job.future.set_running_or_notify_cancel():
                    with self._changed:
                        self._steps.remove(job)
                    continue
                job.future.queued_seconds = started - job.submitted
                self._waited_seconds[LIVE] += job.future.queued_seconds
            riding.append((job, tokens))
        if not riding:
            return
        try:
            results, error = self._run_step([(job.payload, tokens) for job, tokens in riding]), None
        except BaseException as exc:  # every job of the step fails with it: their KV is the turns' to roll back
            results, error = None, exc
        ended = time.perf_counter()
        self._busy_seconds[LIVE] += ended - started
        self._batched["steps"] += 1
        self._batched["rows"] += sum(len(tokens) for _, tokens in riding)
        self._batched["sessions"] += len(riding)
        finished = []
        with self._changed:
            for index, (job, tokens) in enumerate(riding):
                job.fed += len(tokens)
                if error is not None or job.fed == len(job.tokens):
                    self._steps.remove(job)
                    finished.append((job, None if error is not None else results[index]))
            # Their turns sample and send the next token at once: the next step waits briefly for them.
            self._expected = {job.stream for job, _ in finished if error is None and job.stream is not None}
            self._last_step_end = ended
        for job, result in finished:
            self._jobs[LIVE] += 1
            if error is None:
                job.future.set_result(result)
            else:
                job.future.set_exception(error)

    # -- reading ------------------------------------------------------------------------------------

    def busy(self) -> dict:
        """Time the thread spent on live work (turns, restores) and on background work (compression)."""
        return {"live_seconds": round(self._busy_seconds[LIVE], 3),
                "background_seconds": round(self._busy_seconds[BACKGROUND], 3),
                "live_jobs": self._jobs[LIVE], "background_jobs": self._jobs[BACKGROUND]}

    def batching(self) -> dict:
        """Steps run, and the rows and conversations they carried: mean batch = sessions / steps."""
        return dict(self._batched)

    def is_idle(self) -> bool:
        """Nothing running, waiting, or about to come (a turn of the last step sending its next token): a
        job submitted now would hold no one up. A hint: work may arrive the moment after."""
        with self._changed:
            return not (self._running or self._steps or self._expected or any(self._jobs_in_line))

    def live_backlog(self) -> int:
        """The live work in hand, in tokens: what the step jobs have left to run, one for each turn about to send
        its next token, and one for each other live job (running or in line). 0: a live job submitted now waits
        at most for the background job under way, if any."""
        with self._changed:
            steps = sum(len(job.tokens) - job.fed for job in self._steps)
            jobs = len(self._jobs_in_line[LIVE]) + self._running_live_job
            return steps + len(self._expected - {job.stream for job in self._steps}) + jobs

    def live_waiting(self) -> bool:
        """Live work (a step job, another live job) is in line: a background job under way gives way to it
        between two layers if it can (ModelWorker.prefill's `give_way`). Read without the lock: a hint, on the
        job's thread, at every layer."""
        return bool(self._jobs_in_line[LIVE] or self._steps)

    def depth(self) -> dict:
        """Jobs waiting in line now, per priority (a cancelled one counts until the thread reaches it);
        live counts step jobs not finished."""
        with self._changed:
            return {"live": len(self._jobs_in_line[LIVE]) + len(self._steps),
                    "background": len(self._jobs_in_line[BACKGROUND])}

    def waited(self) -> dict:
        """Seconds that the jobs run so far waited in line before they started, per priority."""
        return {"live": self._waited_seconds[LIVE], "background": self._waited_seconds[BACKGROUND]}

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Runs what was queued, then stops; no new work is taken."""
        with self._changed:
            self._closed = True
            self._expected.clear()
            self._changed.notify()
        if wait:
            self._thread.join()
