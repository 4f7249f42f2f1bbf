#!/usr/bin/env bash
# One prepared run of the GPU suite and the GPU restore benchmark on a lent GPU machine (the device tool):
# installs the project's requirements that its image lacks from wheels carried in .whl/ (made by
# scripts/gpu-wheels.sh), then runs what
# `make test-gpu` runs and the full benchmark, each bounded, writing logs and JSON under $OUT.
# Usage (from the repository root there): bash scripts/gpu-check.sh [tests|bench|all]
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  # By name from .whl/, so pip picks each binary wheel built for the python found there (.whl/ may hold several).
  names=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort -u)
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $names \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 STATEKEEPER_COMMIT=${STATEKEEPER_COMMIT:-unknown}
{ nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
  python3 -c "import cupy; print('cupy', cupy.__version__)"; nproc; } 2>&1 | tee "$OUT/machine.txt"
if [ "$what" != bench ]; then
  timeout 100 python3 -m pytest -m cuda tests/gpu -q -p no:cacheprovider --timeout 60 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if [ "$what" != tests ]; then
  timeout 60 python3 -m benchmarks.gpu_attention --json "$OUT/gpu-attention.json" 2>&1 | tee "$OUT/bench-attention.log" | tail -10
  timeout 120 python3 -m benchmarks.gpu_restore --shapes smollm2-135m --lengths 1024,4096,16384 --repeats 7 \
    --json "$OUT/gpu-restore-smollm2.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/bench-smollm2.log" | tail -30
  timeout 160 python3 -m benchmarks.gpu_restore --shapes llama-8b --lengths 4096,16384 --message 0 \
    --repeats 5 --json "$OUT/gpu-restore-llama8b.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/bench-llama8b.log" | tail -30
fi
