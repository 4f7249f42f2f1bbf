"""SIGKILL at random moments under heavy demotion: no completed turn is lost, and no stored blob that
reaches the model differs from what the history implies."""

import asyncio
import random
import signal
import subprocess
import sys
import time

import torch

from statekeeper.assembly import build_service
from statekeeper.sessions import TurnRequest
from tests.conftest import REPO
from tests.utils.crash_worker import crash_config


def _acknowledged(journal) -> dict[str, int]:
    turns = {}
    for line in journal.read_text().splitlines():
        session, count = line.split()
        turns[session] = max(turns.get(session, 0), int(count))
    return turns


def _check_recovered_state(data_dir, worker, acknowledged) -> dict[str, int]:
    service = build_service(crash_config(data_dir), worker)
    sources = {"restored": 0, "recomputed": 0}
    try:
        for session, turns in acknowledged.items():
            conversation = service.history.load(session)
            assert conversation is not None and conversation.turns >= turns, f"lost a completed turn of {session}"
            loaded = service.loader.load(session, conversation.tokens)
            if loaded is None:
                sources["recomputed"] += 1
                continue
            cache = loaded.cache
            sources["restored"] += 1
            reference = worker.new_cache()
            worker.prefill(reference, conversation.tokens[: cache.num_tokens])
            for (k, v), (rk, rv) in zip(cache.export_layers(), reference.export_layers()):
                assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)
        errors = sum(t["errors"] for t in service.tiers.stats())
        assert errors == 0, "a stored blob failed validation"

        async def one_more_turn():
            session = next(iter(acknowledged))
            async for event in service.turn(session, TurnRequest("And then?", max_tokens=4)):
                pass
            return event

        assert asyncio.run(one_more_turn()).completion_tokens == 4
    finally:
        service.close()
    return sources


def test_sigkill_under_heavy_demotion(tmp_path, tiny_model_dir, tiny_worker):
    data_dir, journal = tmp_path / "data", tmp_path / "journal"
    journal.touch()
    rng = random.Random(1234)
    totals = {"restored": 0, "recomputed": 0}
    for cycle in range(4):
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.utils.crash_worker", str(tiny_model_dir), str(data_dir), str(journal),
             str(cycle)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        before = len(journal.read_text().splitlines())
        deadline = time.monotonic() + 120
        while len(journal.read_text().splitlines()) < before + 5 and time.monotonic() < deadline:
            assert process.poll() is None, process.stderr.read().decode()[-3000:]
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # a random moment mid-turn, mid-offload or mid-demotion
        process.send_signal(signal.SIGKILL)
        process.wait()
        acknowledged = _acknowledged(journal)
        assert acknowledged
        for key, value in _check_recovered_state(data_dir, tiny_worker, acknowledged).items():
            totals[key] += value
    assert totals["restored"] > 0  # the check did exercise stored blobs
