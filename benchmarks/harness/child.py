"""A measurement in a fresh process: what a script's own child run prints as its last line, as JSON. For
measurements that a process keeps state across (kernel caches, a profiler's leftovers, environment read at
first use), so each configuration starts from the same place."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.harness.machine import REPO


def child_result(module: str, arguments: list[str], env: dict[str, str] | None = None) -> dict:
    """Runs `python -m module *arguments` from the repository root with `env` added to this environment, and
    returns its last stdout line read as JSON (a failed child raises CalledProcessError)."""
    done = subprocess.run([sys.executable, "-m", module, *arguments], cwd=REPO, env=os.environ | (env or {}),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
