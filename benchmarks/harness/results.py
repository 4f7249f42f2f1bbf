"""What a benchmark's --json file holds besides its figures: the machine and the commit it ran on
(`machine_record`), so that a result file read later says where it came from. `write_json` writes a
script's payload with that record under "machine"."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.harness.machine import REPO, commit, cpu_model, machine_line, torch_version


def uncommitted_changes() -> bool:
    """Whether tracked files of the checkout differ from its commit (untracked files do not count)."""
    try:
        return bool(subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                                   cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return False


def load_average() -> list[str]:
    """The 1, 5 and 15 minute load averages as /proc/loadavg writes them (none where it cannot be read)."""
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def machine_record() -> dict:
    """The machine line and its parts, the commit (noting uncommitted changes) and the load average now."""
    return {"line": machine_line(), "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch_version(),
            "python": platform.python_version(),
            "commit": commit() + (" (with uncommitted changes)" if uncommitted_changes() else ""),
            "loadavg": load_average()}


def _jsonable(value):
    """What json has no type for: a set as a list, anything else (a Path, a dtype) as its str()."""
    if isinstance(value, (set, frozenset)):
        return list(value)
    return str(value)


def write_json(path, payload: dict, machine: dict | None = None) -> None:
    """`payload` and "machine" (`machine`, a record the script took at the start of its run, or else one taken
    now) into `path`, its folder made if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = payload | {"machine": machine if machine is not None else machine_record()}
    path.write_text(json.dumps(record, indent=2, default=_jsonable) + "\n")
