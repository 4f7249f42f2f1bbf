"""The machine a figure was measured on, in one line every benchmark prints with its results: the CPU by
name (torch picks other kernels on an AMD EPYC than on an Intel Xeon with AMX, so figures from the two are
not comparable), the instruction sets those kernels depend on, cores, torch and the commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from statekeeper.machine import cpu_flags, cpu_model  # the runtime's: its measurements are kept per CPU by them

REPO = Path(__file__).resolve().parents[2]


def commit() -> str:
    if os.environ.get("STATEKEEPER_COMMIT"):  # a copy of the tree without its .git (a lent GPU machine)
        return os.environ["STATEKEEPER_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def checkout_commit(repo: Path) -> str:
    """The full commit of the checkout at `repo` (another than this one: a baseline worktree), noting tracked
    files that differ from it; "unknown" where git cannot tell."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(repo), "--no-optional-locks", "status", "--porcelain",
                                  "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if head and changed else "")


def torch_version() -> str:
    try:
        return version("torch")
    except PackageNotFoundError:
        return "none"


def machine_line() -> str:
    return (f"{cpu_model()} ({' '.join(cpu_flags()) or 'no AVX2'}), {os.cpu_count()} cores, torch {torch_version()}, "
            f"Python {platform.python_version()}, commit {commit()}")
