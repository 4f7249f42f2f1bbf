"""The layering contracts of pyproject.toml ([tool.importlinter]), checked by import-linter over the source
tree: every import arrow points down (api -> statekeeper -> scheduler / storage / kernels), and no new
import cycle appears inside a package. A copy of the tree with one upward import added must fail them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("api", "statekeeper", "storage", "scheduler", "kernels")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                          timeout=120)


def test_the_source_tree_keeps_its_layers():
    run = lint_imports(REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


@pytest.mark.parametrize("module, upward", [
    ("storage/tier.py", "import api.app"),  # storage reaching the HTTP layer
    ("scheduler/batch.py", "import statekeeper.worker"),  # the scheduler reaching the service
    ("statekeeper/worker.py", "import api.deps"),  # the service reaching the HTTP layer
    ("storage/dram.py", "import scheduler.batch"),  # one bottom package reaching another
    ("statekeeper/kv_cache.py", "import statekeeper.sessions.service"),  # a new cycle
])
def test_an_import_against_the_layers_is_caught(tmp_path, module, upward):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as source:
        source.write(f"\n{upward}  # deliberately against the layers\n")
    run = lint_imports(tmp_path)
    assert run.returncode != 0 and "BROKEN" in run.stdout, run.stdout[-3000:]
