import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
HARNESS_NAMES = ("statekeeper.fidelity", "statekeeper.calibration", "statekeeper.needles", "statekeeper.datasets")


def test_the_server_never_imports_the_evaluation_harness():
    # A fresh interpreter: this test session has imported the harness already.
    code = ("import json, sys, api.app, statekeeper.assembly; "
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('statekeeper'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "statekeeper.assembly" in loaded
    harness = [name for name in loaded if name.startswith("statekeeper.evaluation")
               or name.startswith(HARNESS_NAMES)]
    assert harness == []
