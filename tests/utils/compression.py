"""Waiting, as a client would, for the background compression of a stored blob."""

import time


def wait_until_compressed(client, session_id: str, timeout_s: float = 60.0) -> dict:
    """GETs the session until its stored blob reports compressed (or the time is up); returns the view."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = client.get(f"/v1/sessions/{session_id}").json()
        if view["is_compressed"] or time.monotonic() > deadline:
            return view
        time.sleep(0.1)
