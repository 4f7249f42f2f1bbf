"""The machine the process runs on, as far as choices measured on it depend on it: the CPU by name (torch's
kernels differ between an Intel Xeon with AMX and an AMD EPYC, so a timing from one is not the other's)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
