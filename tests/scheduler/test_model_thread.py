import threading
import time

import pytest

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
