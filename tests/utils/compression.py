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


def with_index_positions(tensors: dict) -> dict:
    """A per-head stored form with its kept bits ("<layer>.kept") rewritten as kept-token numbers
    ("<layer>.index", int16): the layout every blob was written in before the bits."""
    import torch

    from statekeeper.compression.head_budget import kept_rows

    result = dict(tensors)
    for name in [name for name in tensors if name.endswith(".kept")]:
        layer = name.rpartition(".")[0]
        _, positions = kept_rows({"kept": result.pop(name), "counts": tensors[f"{layer}.counts"]})
        result[f"{layer}.index"] = positions.to(torch.int16)
    return result
