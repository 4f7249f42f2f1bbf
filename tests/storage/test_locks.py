import threading
import time

from storage.locks import SharedLock


def test_shared_holders_run_together_and_the_exclusive_side_waits_for_them():
    lock, inside, events = SharedLock(), threading.Barrier(2, timeout=5), []

    def reader():
        with lock.shared():
            inside.wait()  # both readers are in at once, or this times out
            time.sleep(0.05)
            events.append("read")

    readers = [threading.Thread(target=reader) for _ in range(2)]
    for thread in readers:
        thread.start()
    time.sleep(0.01)
    with lock.exclusive():
        events.append("write")
    for thread in readers:
        thread.join()
    assert events == ["read", "read", "write"]


def test_a_reader_takes_the_shared_side_again_while_a_writer_waits():
    """LMDB's read view is held while a restore runs; a nested read on that thread must not deadlock."""
    lock, order = SharedLock(), []

    def write():
        with lock.exclusive():
            order.append("write")

    with lock.shared():
        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.05)  # the writer now waits for this reader
        with lock.shared():
            order.append("nested read")
    writer.join(5)
    assert order == ["nested read", "write"]
