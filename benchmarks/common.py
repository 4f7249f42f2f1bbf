"""What the benchmarks share: the model options and loading the worker they time."""

from __future__ import annotations

import argparse
from pathlib import Path

from statekeeper.config import WorkerConfig
from statekeeper.model_loader import load_model
from statekeeper.worker import ModelWorker

MODEL_CACHE = Path(__file__).resolve().parents[1] / ".cache" / "models"


def add_model_arguments(parser: argparse.ArgumentParser, threads: int = 1) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 or a local Hugging Face model directory")
    parser.add_argument("--model-cache", default=str(MODEL_CACHE))
    parser.add_argument("--threads", type=int, default=threads)


def load_worker(args: argparse.Namespace) -> ModelWorker:
    config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), num_threads=args.threads)
    return ModelWorker(load_model(config.model, config.model_cache_dir), config)
