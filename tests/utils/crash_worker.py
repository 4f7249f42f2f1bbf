"""Runs turns under heavy demotion until killed. Every completed turn is appended to a journal
(fsynced) before the next starts, so the parent knows what must survive a SIGKILL.

    python -m tests.utils.crash_worker MODEL_DIR DATA_DIR JOURNAL SEED
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from statekeeper.config import CompressionConfig, ServiceConfig, SessionConfig, TierConfig, WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.assembly import build_service
from statekeeper.sessions import TurnRequest
from statekeeper.worker import ModelWorker

KB = 1024
PROMPTS = ["Hello, how are you today?", "Tell me about the history of Rome.", "What is the capital of France?",
           "Remember it please.", "The quick brown fox jumps over the lazy dog."]


def crash_config(data_dir: Path) -> ServiceConfig:
    # Budgets of a few blobs each: nearly every offload demotes or evicts something.
    return ServiceConfig(
        data_dir=data_dir,
        # Lossless: the check compares every restored state with a fresh prefill.
        sessions=SessionConfig(idle_offload_seconds=0.0, active_kv_budget_bytes=200 * KB, sweep_interval_seconds=0.02,
                               compression=CompressionConfig(policy="none", codec="none")),
        tiers=[TierConfig("dram", 300 * KB), TierConfig("lmdb", 600 * KB, data_dir / "kv.lmdb"),
               TierConfig("ssd", 900 * KB, data_dir / "kv-files")],
    )


async def main(model_dir: str, data_dir: str, journal: str, seed: int) -> None:
    rng = random.Random(seed)
    worker_config = WorkerConfig(model=model_dir, prefill_chunk_tokens=64)
    worker = ModelWorker(load_model(model_dir, Path(data_dir)), worker_config)
    service = build_service(crash_config(Path(data_dir)), worker)
    await service.start()
    sessions = service.history.ids()
    with open(journal, "a") as log:
        while True:
            if len(sessions) < 6 or rng.random() < 0.1:
                sessions.append((await service.create(None, None)).id)
            session = rng.choice(sessions)
            if len(service.history.load(session).tokens) > 700:
                continue
            async for _ in service.turn(session, TurnRequest(rng.choice(PROMPTS), max_tokens=rng.randint(4, 12))):
                pass
            log.write(f"{session} {service.history.load(session).turns}\n")
            log.flush()
            os.fsync(log.fileno())
            if rng.random() < 0.5:
                await service.offload(session)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
