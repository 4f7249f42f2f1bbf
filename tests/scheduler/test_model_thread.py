import threading
import time

import pytest

from scheduler.batch import BatchLimits, StepAbandoned
from scheduler.model_thread import ModelThread


def test_live_work_overtakes_queued_background_work_and_each_class_stays_fifo():
    thread = ModelThread()
    gate, order = threading.Event(), []
    first = thread.submit(gate.wait)  # holds the thread while the queue fills
    futures = [thread.submit_background(order.append, "b1"), thread.submit_background(order.append, "b2"),
               thread.submit(order.append, "l1"), thread.submit(order.append, "l2")]
    gate.set()
    for future in [first, *futures]:
        future.result(timeout=5)
    assert order == ["l1", "l2", "b1", "b2"]
    thread.shutdown()


def test_errors_reach_the_caller_and_shutdown_runs_what_was_queued_then_refuses():
    thread = ModelThread()
    with pytest.raises(ZeroDivisionError):
        thread.submit(lambda: 1 / 0).result(timeout=5)
    late = thread.submit_background(lambda: "done")
    thread.shutdown(wait=True)
    assert late.result(timeout=0) == "done"
    with pytest.raises(RuntimeError):
        thread.submit(print)


def test_depth_counts_the_jobs_in_line_per_priority_and_waits_add_up():
    thread = ModelThread()
    gate = threading.Event()
    first = thread.submit(gate.wait)  # holds the thread while the queue fills
    while thread.depth()["live"]:  # until the thread has taken it out of the line
        time.sleep(0.001)
    queued = [thread.submit_background(int), thread.submit_background(int), thread.submit(int)]
    assert thread.depth() == {"live": 1, "background": 2}
    gate.set()
    for future in [first, *queued]:
        future.result(timeout=5)
    assert thread.depth() == {"live": 0, "background": 0}
    waited = thread.waited()
    assert waited["live"] >= queued[2].queued_seconds > 0
    assert waited["background"] >= queued[0].queued_seconds + queued[1].queued_seconds - 1e-9
    thread.shutdown()


class RecordingRunner:
    """A stand-in for the worker's batched forward: records each step's (payload, tokens) and answers
    each entry with its payload and the step's number."""

    def __init__(self, gate: threading.Event | None = None):
        self.steps: list[list[tuple[str, int]]] = []
        self.gate = gate

    def __call__(self, entries):
        if self.gate is not None:
            self.gate.wait(5)
        self.steps.append([(payload, len(tokens)) for payload, tokens in entries])
        return [(payload, len(self.steps)) for payload, _ in entries]


def test_step_jobs_in_line_together_run_in_one_step_and_a_prefill_rides_a_chunk_at_a_time():
    gate = threading.Event()
    runner = RecordingRunner(gate)
    thread = ModelThread(runner, BatchLimits(chunk_tokens=4, prefill_tokens=4))
    first = thread.submit_step("a", "a", [1])  # holds the thread (in the gate) while the others line up
    while not thread.depth()["live"] == 1 or not first.future.running():
        time.sleep(0.001)
    jobs = [thread.submit_step("b", "b", [1]), thread.submit_step("c", "c", list(range(10)))]
    gate.set()
    assert first.future.result(timeout=5) == ("a", 1)
    assert jobs[0].future.result(timeout=5) == ("b", 2)
    assert jobs[1].future.result(timeout=5) == ("c", 4)  # its last chunk's step
    assert runner.steps[:4] == [[("a", 1)], [("b", 1), ("c", 4)], [("c", 4)], [("c", 2)]]
    assert thread.batching() == {"steps": 4, "rows": 12, "sessions": 5}
    thread.shutdown()


def test_the_next_step_waits_briefly_for_the_turns_of_the_last_one():
    runner = RecordingRunner()
    thread = ModelThread(runner, BatchLimits(gather_seconds=0.5))
    a, b = thread.submit_step("a", "a", [1]), None
    a.future.result(timeout=5)
    # "a" comes back 50 ms after "b": without the wait for "a", "b" would run alone.
    b = thread.submit_step("b", "b", [1])
    time.sleep(0.05)
    a2 = thread.submit_step("a", "a", [1])
    assert b.future.result(timeout=5)[1] == a2.future.result(timeout=5)[1] == 2
    thread.end_stream("a")
    thread.end_stream("b")
    c = thread.submit_step("c", "c", [1])  # nobody is expected any more: no wait
    started = time.perf_counter()
    c.future.result(timeout=5)
    assert time.perf_counter() - started < 0.4
    thread.shutdown()


def test_a_live_job_runs_between_two_steps_and_background_work_waits_for_both():
    gate = threading.Event()
    order = []
    runner = RecordingRunner(gate)
    thread = ModelThread(lambda entries: order.append("step") or runner(entries), BatchLimits(chunk_tokens=2, prefill_tokens=2))
    prefill = thread.submit_step(None, "p", list(range(6)))  # three steps
    while not prefill.future.running():
        time.sleep(0.001)
    background = thread.submit_background(order.append, "background")
    live = thread.submit(order.append, "live")
    gate.set()
    for future in (prefill.future, live, background):
        future.result(timeout=5)
    assert order == ["step", "live", "step", "step", "background"]
    thread.shutdown()


def test_an_abandoned_job_never_runs_if_it_had_not_started_and_stops_between_steps_if_it_had():
    gate = threading.Event()
    runner = RecordingRunner(gate)
    thread = ModelThread(runner, BatchLimits(chunk_tokens=2, prefill_tokens=2, gather_seconds=0))
    under_way = thread.submit_step(None, "p", list(range(6)))
    while not under_way.future.running():
        time.sleep(0.001)
    queued = thread.submit_step(None, "q", [1])
    thread.abandon(queued)
    thread.abandon(under_way)
    gate.set()
    with pytest.raises(StepAbandoned):
        under_way.future.result(timeout=5)
    assert queued.future.cancelled()
    assert runner.steps == [[("p", 2)]]
    assert thread.depth() == {"live": 0, "background": 0}
    thread.shutdown()


def test_a_failing_step_fails_every_job_riding_it_and_the_thread_goes_on():
    calls = []

    def runner(entries):
        calls.append(len(entries))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return [None] * len(entries)

    thread = ModelThread(runner)
    with pytest.raises(RuntimeError):
        thread.submit_step(None, "a", [1]).future.result(timeout=5)
    assert thread.submit_step(None, "b", [1]).future.result(timeout=5) is None
    thread.shutdown()


def test_a_one_off_job_is_not_waited_for_after_it_finished():
    runner = RecordingRunner()
    thread = ModelThread(runner, BatchLimits(gather_seconds=5))
    thread.submit_step(None, "recompute", [1, 2]).future.result(timeout=5)
    started = time.perf_counter()
    thread.submit_step("t", "turn", [1]).future.result(timeout=5)
    assert time.perf_counter() - started < 1
    thread.shutdown()


def test_the_thread_is_idle_only_with_nothing_running_waiting_or_about_to_come():
    thread = ModelThread(run_step=lambda entries: [None] * len(entries),
                         limits=BatchLimits(gather_seconds=0.2))
    assert thread.is_idle()
    gate = threading.Event()
    running = thread.submit(gate.wait)
    while thread.depth()["live"]:  # taken out of the line: running, not waiting
        time.sleep(0.001)
    assert not thread.is_idle()
    gate.set()
    running.result(timeout=5)
    stream = object()
    thread.submit_step(stream, None, [1]).future.result(timeout=5)
    assert not thread.is_idle()  # its turn is expected to send its next token
    thread.end_stream(stream)
    assert thread.is_idle()
    thread.shutdown()


def test_the_initializer_runs_on_the_thread_before_any_job_and_its_error_reaches_the_constructor():
    seen = []
    thread = ModelThread(initializer=lambda: seen.append(threading.current_thread().name))
    assert seen == ["statekeeper-model"]  # done before the constructor returned
    assert thread.submit(lambda: threading.current_thread().name).result() == "statekeeper-model"
    thread.shutdown()

    def fails():
        raise RuntimeError("no threads for you")

    with pytest.raises(RuntimeError, match="no threads for you"):
        ModelThread(initializer=fails)
