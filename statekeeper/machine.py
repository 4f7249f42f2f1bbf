"""The machine the process runs on, as far as choices measured on it depend on it: the CPU by name and the
instruction sets its kernels dispatch on (torch's kernels differ between an Intel Xeon with AMX and an AMD
EPYC, so a timing from one is not the other's), torch's version, a GPU by name, and the limits the
environment puts on the kernel libraries' instruction sets (a Xeon told ONEDNN_MAX_CPU_ISA=
AVX512_CORE_BF16 runs an EPYC's oneDNN kernels). Measurements are kept per machine in JSON files."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# The settings with which oneDNN, MKL and ATen pick other kernels than the CPU's best.
KERNEL_LIMITS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
# The instruction sets those kernels dispatch on (x86 "flags", arm64 "Features"): a hypervisor that hides
# AVX-512 or AMX, or an arm64 core with or without bf16, runs other kernels under the same name.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile",
                "asimd", "sve", "bf16", "i8mm")


def describe_cpu(cpuinfo: str) -> tuple[str, list[str]]:
    """The CPU's name and its KERNEL_FLAGS, from /proc/cpuinfo's text. An arm64 CPU has no model name there:
    it is named by its implementer and part numbers (a Graviton2 and a Graviton3 are two CPUs)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    name = fields.get("model name")
    if not name and ("CPU implementer" in fields or "CPU part" in fields):
        name = f"{platform.machine()} implementer {fields.get('CPU implementer', '?')} part {fields.get('CPU part', '?')}"
    present = set((fields.get("flags") or fields.get("Features") or "").split())
    return name or platform.processor() or platform.machine(), [flag for flag in KERNEL_FLAGS if flag in present]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    return describe_cpu(_cpuinfo())[0]


def cpu_flags() -> list[str]:
    return describe_cpu(_cpuinfo())[1]


def machine_id(device=None) -> str:
    """What a timing holds for: the CPU's name and instruction sets, torch (its kernels), the kernel limits
    set in the environment if any, and for a measurement on a GPU (`device`, a torch.device) the GPU's name."""
    import torch

    name, flags = describe_cpu(_cpuinfo())
    limits = [f"{limit}={os.environ[limit]}" for limit in KERNEL_LIMITS if os.environ.get(limit)]
    described = f"{name} ({' '.join(flags) or 'no listed ISA'}), torch {torch.__version__}"
    if device is not None and device.type == "cuda":
        described += f", {torch.cuda.get_device_name(device)}"
    return described + (f" [{', '.join(limits)}]" if limits else "")


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


def load_measurement(path: Path, device=None) -> dict | None:
    """What was measured into `path` on this machine (machine_id, with `device` where the measurement ran on a
    GPU); None if nothing was, or on another."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        log.warning("re-measuring: unreadable %s (%s)", path, exc)
        return None
    return data if isinstance(data, dict) and data.get("cpu") == machine_id(device) else None


def load_timings(path: Path, record: type, device=None) -> list | None:
    """The "timings" measured into `path` on this machine, each as a `record` (a dataclass of int, float and str
    fields); None if there are none, or they cannot be read or are not of those types (then they are measured
    again: a file that parses but holds a null or a string where a time is would fail the start)."""
    data = load_measurement(path, device)
    if data is None:
        return None
    try:
        timings = [record(**timing) for timing in data["timings"]]
    except (KeyError, TypeError) as exc:
        log.warning("re-measuring: unreadable timings in %s (%s)", path, exc)
        return None
    if not all(_well_typed(timing) for timing in timings):
        log.warning("re-measuring: timings of the wrong types in %s", path)
        return None
    return timings or None


def _well_typed(timing) -> bool:
    for field in dataclasses.fields(timing):
        value, kind = getattr(timing, field.name), str(field.type)
        if kind == "int" and type(value) is not int:
            return False
        if kind == "float" and (type(value) not in (int, float) or not math.isfinite(value)):
            return False
        if kind == "str" and type(value) is not str:
            return False
    return True


def save_measurement(path: Path, data: dict, device=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": machine_id(device)} | data))
