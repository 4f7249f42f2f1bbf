import threading
import time

from scheduler.batch import BatchLimits
from scheduler.lanes import ModelLanes

CHUNK = 64


def _lanes(long_lane=True, gather_seconds=0.005) -> ModelLanes:
    limits = BatchLimits(chunk_tokens=CHUNK, prefill_tokens=CHUNK, gather_seconds=gather_seconds)
    return ModelLanes(lambda segments: [None] * len(segments), limits, lambda: None, long_lane)


def _hold(thread) -> threading.Event:
    """Holds `thread` with a job until the returned event is set."""
    gate = threading.Event()
    thread.submit(gate.wait)
    while thread.depth()["live"]:  # until the thread has taken it out of the line
        time.sleep(0.001)
    return gate


def test_prompts_longer_than_a_chunk_take_the_long_lane_and_decodes_the_model_thread():
    lanes = _lanes()
    try:
        assert lanes.for_tokens(CHUNK + 1) is lanes.long
        assert lanes.for_tokens(CHUNK) is lanes.main  # both idle: the model thread, where it shares steps
        assert lanes.for_tokens(1) is lanes.main
    finally:
        lanes.shutdown()


def test_a_short_prompt_takes_the_idle_long_lane_while_the_model_thread_is_busy():
    lanes = _lanes()
    gate = _hold(lanes.main)
    try:
        assert lanes.for_tokens(CHUNK) is lanes.long
        assert lanes.for_tokens(2) is lanes.long
        assert lanes.for_tokens(1) is lanes.main  # a decode step waits for the model thread's next step
        long_gate = _hold(lanes.long)
        try:
            assert lanes.for_tokens(2) is lanes.main  # both busy: in line for the steps it can share
        finally:
            long_gate.set()
    finally:
        gate.set()
        lanes.shutdown()


def test_a_short_prompt_takes_the_long_lane_over_its_background_work_while_the_model_thread_is_busy():
    lanes = _lanes()
    gate, background_gate = _hold(lanes.main), threading.Event()
    lanes.long.submit_background(background_gate.wait)
    try:
        assert lanes.for_tokens(2) is lanes.long  # it waits for the background job under way at most
    finally:
        background_gate.set()
        gate.set()
        lanes.shutdown()


def test_the_model_thread_holds_live_work_while_a_stream_is_about_to_send_its_next_token():
    lanes = _lanes(gather_seconds=30.0)  # the next step waits this long for the stream's token
    try:
        job = lanes.main.submit_step("stream", None, [1])
        job.future.result(timeout=5)  # its turn sends its next token at once: the next step waits for it
        assert lanes.main.live_backlog() == 1 and lanes.for_tokens(2) is lanes.long
        lanes.main.end_stream("stream")
        assert lanes.main.live_backlog() == 0 and lanes.for_tokens(2) is lanes.main
    finally:
        lanes.shutdown()


def test_short_prompts_in_a_burst_go_to_the_lane_with_fewer_tokens_in_hand():
    lanes = _lanes()
    gate, long_gate = _hold(lanes.main), _hold(lanes.long)  # both run another user's job meanwhile
    try:
        placed = []
        for tokens in (40, 30, 20, 10):
            lane = lanes.for_tokens(tokens)
            lane.submit_step(None, None, list(range(tokens)))
            placed.append("long" if lane is lanes.long else "main")
        # Backlogs (main, long) in tokens: (1, 1) -> main; (41, 1) -> long; (41, 31) -> long; (41, 51) -> main.
        assert placed == ["main", "long", "long", "main"]
        assert (lanes.main.live_backlog(), lanes.long.live_backlog()) == (1 + 40 + 10, 1 + 30 + 20)
    finally:
        gate.set()
        long_gate.set()
        lanes.shutdown()


def test_without_a_long_lane_everything_runs_on_the_model_thread():
    lanes = _lanes(long_lane=False)
    gate = _hold(lanes.main)
    try:
        assert lanes.for_tokens(CHUNK + 1) is lanes.main and lanes.for_tokens(2) is lanes.main
    finally:
        gate.set()
        lanes.shutdown()
