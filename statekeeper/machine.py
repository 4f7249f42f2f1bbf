"""The machine the process runs on, as far as choices measured on it depend on it: the CPU by name (torch's
kernels differ between an Intel Xeon with AMX and an AMD EPYC, so a timing from one is not the other's) and
the limits the environment puts on the kernel libraries' instruction sets (a Xeon told ONEDNN_MAX_CPU_ISA=
AVX512_CORE_BF16 runs an EPYC's oneDNN kernels). Measurements are kept per machine in JSON files."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# The settings with which oneDNN, MKL and ATen pick other kernels than the CPU's best.
KERNEL_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_id() -> str:
    """The CPU's name, with the kernel limits set in the environment if any: what a timing holds for."""
    limits = [f"{name}={os.environ[name]}" for name in KERNEL_LIMITS if os.environ.get(name)]
    return cpu_model() + (f" [{', '.join(limits)}]" if limits else "")


def median_ms(call: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls, after one untimed call that warms the shapes up."""
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def measurement_path(directory: Path, kind: str, fingerprint: str, worker) -> Path:
    """Where a measurement of `kind` is kept: per model (`fingerprint`), device and the worker's threads."""
    return directory / f"{kind}-{fingerprint}-{worker.device.type}-t{worker.config.num_threads}.json"


def load_measurement(path: Path) -> dict | None:
    """What was measured into `path` on this machine (machine_id); None if nothing was, or on another."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        log.warning("re-measuring: unreadable %s (%s)", path, exc)
        return None
    return data if isinstance(data, dict) and data.get("cpu") == machine_id() else None


def load_timings(path: Path, record: type) -> list | None:
    """The "timings" measured into `path` on this machine, each as a `record` (a dataclass); None if there are
    none, or they cannot be read (then they are measured again)."""
    data = load_measurement(path)
    if data is None:
        return None
    try:
        return [record(**timing) for timing in data["timings"]] or None
    except (KeyError, TypeError) as exc:
        log.warning("re-measuring: unreadable timings in %s (%s)", path, exc)
        return None


def save_measurement(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": machine_id()} | data))
