"""The model options of the benchmarks that time a worker in their own process, and loading that worker.
statekeeper (and so torch) is imported only when a worker is loaded, so that the scripts which talk to a
service over HTTP take MODEL_CACHE from here too without loading torch on the client side."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness.machine import REPO

if TYPE_CHECKING:
    from statekeeper.worker import ModelWorker

MODEL_CACHE = REPO / ".cache" / "models"


def add_model_arguments(parser: argparse.ArgumentParser, threads: int = 1) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 or a local Hugging Face model directory")
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    parser.add_argument("--threads", type=int, default=threads)


def load_worker(args: argparse.Namespace) -> ModelWorker:
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), num_threads=args.threads)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)
