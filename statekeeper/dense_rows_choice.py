"""Which GEMM the weight-only layers (kernels/weight_linear.py) hand a many-row product to, and from how many
rows instead of their quantized kernel, chosen by measurement on the machine the service runs on. The quantized
kernel's time grows with every row, a GEMM's barely until its tiles fill, but a GEMM reads 2 (bfloat16,
kernels/bf16_gemm.py) or 4 (float32, kernels/fp32_gemm.py) bytes a weight against 0.5, so where they cross
depends on the CPU's arithmetic and its memory: over the bundled model's layers, with AMX the bfloat16 GEMM is
faster from 12 rows, with oneDNN's AVX-512 BF16 kernels (an AMD EPYC Zen 4's) from 48 (BENCHMARKS.md, issue 31);
on an AVX2-only CPU bfloat16 is emulated and the float32 GEMM is the fast one (issue 30). A batched decode step of
several conversations sits right there. So the three paths are timed over every weight-only layer of the
decoder in turn (as a forward reads them: a layer's weights are no longer in cache when its turn comes again)
at ROW_COUNTS, once, and kept beside the KV dtype's timings per model, device, threads and machine."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kernels.weight_linear import (DENSE_FROM_ROWS, GEMMS, WeightOnlyLinear, default_gemm, use_dense_from_rows,
                                   use_gemm)
from statekeeper.machine import load_timings, machine_id, measurement_path, median_ms, save_measurement
from statekeeper.worker import ModelWorker

log = logging.getLogger(__name__)

ROW_COUNTS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
REPEATS = 3  # timed passes of each path at each count (the median counts), after one that warms up


@dataclass(frozen=True, slots=True)
class RowTiming:
    rows: int
    kernel_us: float  # the quantized kernel, over every weight-only layer of the decoder in turn
    bf16_gemm_us: float  # the bfloat16 GEMM, over the same
    fp32_gemm_us: float  # the float32 GEMM, over the same

    def gemm_us(self, dtype: str) -> float:
        return self.bf16_gemm_us if dtype == "bfloat16" else self.fp32_gemm_us


@dataclass(frozen=True, slots=True)
class DenseRowsChoice:
    rows: int
    reason: str
    cpu: str = ""
    timings: list[RowTiming] = field(default_factory=list)
    gemm: str = "bfloat16"  # the GEMM's dtype (kernels/weight_linear.py GEMMS)

    def report(self) -> dict:
        """`rows` None where the GEMM is never used (NEVER is an internal sentinel, not a row count)."""
        rows = None if self.rows >= NEVER else self.rows
        return {"rows": rows, "gemm": self.gemm, "reason": self.reason, "cpu": self.cpu,
                "timings": [asdict(t) for t in self.timings]}

    def note(self) -> str:
        if self.rows >= NEVER:
            return f"{self.gemm} GEMM never (slower at every row count): {self.reason}"
        return f"{self.gemm} GEMM from {self.rows} rows: {self.reason}"


# No product has this many rows: the quantized kernel takes them all.
NEVER = 2**62


def faster_gemm(timings: list[RowTiming]) -> str:
    """The GEMM that is faster at the most rows measured, where many-row products (prefill chunks) are; the
    bfloat16 one, with half the memory, on a tie."""
    last = timings[-1]
    return "float32" if last.fp32_gemm_us < last.bf16_gemm_us else "bfloat16"


def crossover(timings: list[RowTiming], gemm: str) -> int:
    """The fewest rows from which the `gemm` GEMM is at least as fast as the kernel at every measured count.
    Where it never is within them: where the lines through the last two counts cross, if the GEMM's grows less
    per row (its tiles fill), else NEVER (an emulated bfloat16 GEMM, on a CPU without AVX-512 BF16 or AMX, is
    slower at every count and falls further behind: BENCHMARKS.md issue 31); with one count, past it."""
    rows = None
    for timing in reversed(timings):
        if timing.gemm_us(gemm) > timing.kernel_us:
            break
        rows = timing.rows
    if rows is not None:
        return rows
    if len(timings) < 2:
        return 2 * timings[-1].rows
    before, last = timings[-2], timings[-1]
    kernel_per_row = (last.kernel_us - before.kernel_us) / (last.rows - before.rows)
    gemm_per_row = (last.gemm_us(gemm) - before.gemm_us(gemm)) / (last.rows - before.rows)
    if gemm_per_row >= kernel_per_row:
        return NEVER
    return math.ceil(last.rows + (last.gemm_us(gemm) - last.kernel_us) / (kernel_per_row - gemm_per_row))


@torch.inference_mode()
def measure(layers: list) -> list[RowTiming]:
    """On the model thread: each path through all of `layers`, one after another, at each of ROW_COUNTS. The
    layers hold one GEMM's copy at a time: the one they have is timed first, then they are rebuilt with the
    other (seconds: the int4 codes are read back through the kernel), which they keep."""
    inputs = {rows: {layer.in_features: torch.randn(rows, layer.in_features) for layer in layers}
              for rows in ROW_COUNTS}
    kernel_us = {rows: _time(lambda layer, x: layer.few_rows(x), layers, inputs[rows]) for rows in ROW_COUNTS}
    gemm_us = {}
    first = layers[0].dense.dtype
    for dtype in (first, *(other for other in GEMMS if other != first)):
        use_gemm(layers, dtype)
        gemm_us[dtype] = {rows: _time(lambda layer, x: layer.dense(x), layers, inputs[rows]) for rows in ROW_COUNTS}
    return [RowTiming(rows, kernel_us[rows], gemm_us["bfloat16"][rows], gemm_us["float32"][rows])
            for rows in ROW_COUNTS]


def _time(path, layers: list, inputs: dict) -> float:
    """Microseconds for `path` through every one of `layers` in turn (the median of REPEATS passes)."""
    return 1e3 * median_ms(lambda: [path(layer, inputs[layer.in_features]) for layer in layers], REPEATS)


def choose(worker: ModelWorker, directory: Path) -> DenseRowsChoice | None:
    """On the model thread: measures (once a machine) and applies the crossover to `worker`'s weight-only
    layers; None for a model without any (nothing to choose). An explicit GEMM_ROWS wins."""
    layers = [module for module in worker.decoder_layer_modules() if isinstance(module, WeightOnlyLinear)]
    if not layers:
        return None
    if worker.config.gemm_rows is not None:  # applied by the worker, with the default GEMM
        return DenseRowsChoice(worker.config.gemm_rows, "set by GEMM_ROWS", gemm=default_gemm())
    path = timings_path(directory, worker)
    timings = load_timings(path, RowTiming, worker.device)
    if timings is None or [t.rows for t in timings] != list(ROW_COUNTS):  # another set of rows: measured again
        timings = measure(layers)
        save_measurement(path, {"timings": [asdict(t) for t in timings]}, worker.device)
    gemm = faster_gemm(timings)
    rows = crossover(timings, gemm)
    use_gemm(worker.model.modules(), gemm)  # the output layer's too, as the rows below
    use_dense_from_rows(worker.model.modules(), rows)
    choice = DenseRowsChoice(rows, f"measured on this CPU (the default without a measurement: {default_gemm()} "
                             f"from {DENSE_FROM_ROWS})", machine_id(worker.device), timings, gemm)
    log.info("%s", choice.note())
    return choice


def timings_path(directory: Path, worker: ModelWorker) -> Path:
    return measurement_path(directory, "dense-rows", worker.model_fingerprint, worker)
