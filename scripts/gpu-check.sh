#!/usr/bin/env bash
# One prepared run of the GPU suite and the GPU benchmarks on a lent GPU machine (the device tool):
# installs the project's requirements that its image lacks from wheels carried in .whl/ (made by
# scripts/gpu-wheels.sh, with .gpu-carry/), then runs what `make test-gpu` runs and the benchmarks, each
# bounded, writing logs and JSON under $OUT.
# Usage (from the repository root there): bash scripts/gpu-check.sh [PARTS], PARTS a comma list of tests,
# attention, decode (decode steps as the KV grows), smollm2, llama8b (the GPU restore benchmark in each shape), service (the service under several
# ShareGPT users, benchmarks/gpu_service.py: needs .gpu-carry/ carried too); bench = attention,decode,smollm2,llama8b;
# all (the default) = tests,bench.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
what=,${1:-all},
what=${what//,all,/,tests,bench,}
what=${what//,bench,/,attention,decode,smollm2,llama8b,}
wants() { [[ $what == *,$1,* ]]; }
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
if wants tests; then
  timeout 100 python3 -m pytest -m cuda tests/gpu -q -p no:cacheprovider --timeout 60 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
fi
if wants attention; then
  timeout 60 python3 -m benchmarks.gpu_attention --json "$OUT/gpu-attention.json" 2>&1 | tee "$OUT/bench-attention.log" | tail -10
fi
if wants decode; then
  timeout 90 python3 -m benchmarks.gpu_decode_steps --json "$OUT/gpu-decode-steps.json" 2>&1 \
    | grep -v -E "Loading weights" | tee "$OUT/bench-decode.log" | tail -12
fi
if wants smollm2; then
  timeout 120 python3 -m benchmarks.gpu_restore --shapes smollm2-135m --lengths 1024,4096,16384 --repeats 7 \
    --json "$OUT/gpu-restore-smollm2.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/bench-smollm2.log" | tail -30
fi
if wants llama8b; then
  timeout 160 python3 -m benchmarks.gpu_restore --shapes llama-8b --lengths 4096,16384 --message 0 \
    --repeats 5 --json "$OUT/gpu-restore-llama8b.json" 2>&1 | grep -v -E "Loading weights|Writing model" | tee "$OUT/bench-llama8b.log" | tail -30
fi
if wants service; then
  # PYSPY=N: py-spy (a wheel in .whl/) samples the first service's threads for N seconds, from its start:
  # where the model thread's time goes, Python frames included ($OUT/pyspy-model-thread.txt).
  if [ -n "${PYSPY:-}" ] && [ -x /tmp/site/bin/py-spy ]; then
    ( for _ in $(seq 600); do pid=$(pgrep -f "statekeeper.cli serve" | head -1); [ -n "$pid" ] && break; sleep 0.1; done
      [ -n "$pid" ] && /tmp/site/bin/py-spy record --pid "$pid" -d "$PYSPY" -r 200 -f raw -o "$OUT/pyspy-service.txt" \
        >"$OUT/pyspy.log" 2>&1 ) &
    nvidia-smi dmon -s u -d 1 -c "$PYSPY" >"$OUT/gpu-utilization.txt" 2>&1 &
  fi
  # 6 users x 5 rounds, gaps of 0.04, 1.2 and 12 s (offloaded past 2.4 s): the default against recomputing every
  # resume. On an H100 a configuration took ~125 s at --time-scale 0.05 (29 s of it the service's start).
  timeout ${SERVICE_TIMEOUT:-280} python3 -m benchmarks.gpu_service --carried .gpu-carry --shape smollm2-135m \
    --json "$OUT/gpu-service.json" --logs "$OUT/service-logs" -- --users 6 --rounds 5 --configs default,none \
    --time-scale 0.04 ${SERVICE_ARGS:-} 2>&1 | tee "$OUT/gpu-service.log" | tail -40
  if [ -n "${PYSPY:-}" ]; then  # the raw stacks are too large to bring back: their summary instead
    wait
    [ -s "$OUT/pyspy-service.txt" ] && python3 -m benchmarks.stack_summary "$OUT/pyspy-service.txt" \
      >"$OUT/pyspy-model-thread.txt" && rm "$OUT/pyspy-service.txt" && head -3 "$OUT/pyspy-model-thread.txt"
  fi
fi
