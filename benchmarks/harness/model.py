"""The model options of the benchmarks that time a worker in their own process, and loading that worker.
statekeeper (and so torch) is imported only when a worker is loaded, so that the scripts which talk to a
service over HTTP take MODEL_CACHE from here too without loading torch on the client side."""

from __future__ import annotations

import argparse
import tempfile
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
    parser.add_argument("--gemm-rows", default="measured",
                        help="from how many rows the weight-only layers use the GEMM: measured on this machine, "
                             "as the service does at start (statekeeper/dense_rows_choice.py), or a number")


def load_worker(args: argparse.Namespace) -> ModelWorker:
    from statekeeper.config import WorkerConfig
    from statekeeper.model_loader import load_model
    from statekeeper.worker import ModelWorker

    config = WorkerConfig(model=args.model, model_cache_dir=Path(args.model_cache), num_threads=args.threads)
    worker = ModelWorker(load_model(config.model, config.model_cache_dir), config)
    return use_gemm_rows(worker, args.gemm_rows)


def use_gemm_rows(worker: ModelWorker, setting: str) -> ModelWorker:
    """`worker`, its weight-only layers' GEMM threshold set as --gemm-rows says."""
    from kernels.weight_linear import use_dense_from_rows
    from statekeeper.dense_rows_choice import choose as choose_dense_rows

    if setting == "measured":
        with tempfile.TemporaryDirectory() as directory:  # measured afresh, not read from a profile
            choose_dense_rows(worker, Path(directory))
    else:
        use_dense_from_rows(worker.model.modules(), int(setting))
    return worker
