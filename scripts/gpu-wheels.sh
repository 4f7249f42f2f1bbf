#!/usr/bin/env bash
# The wheels scripts/gpu-check.sh installs on a lent GPU machine, whose image has torch (CUDA), cupy and
# transformers' own requirements but not the service's: downloaded here into .whl/ (kept out of git), the
# binary ones for CPython 3.10-3.13 (gpu-check.sh installs them by name, so pip takes the device python's).
# Also .gpu-carry/ (benchmarks/gpu_service.py --write-carry: SmolLM2's tokenizer, the first ShareGPT conversations),
# what gpu-check.sh's service part needs.
# Usage (from the repository root): bash scripts/gpu-wheels.sh, then carry .whl and .gpu-carry with the device run.
set -eu
mkdir -p .whl
grep -qx ".whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo ".whl/" >> .git/info/exclude; }
transformers=$(python3 -c "import re,tomllib;d=tomllib.load(open('pyproject.toml','rb'));print(next(r for r in d['project']['dependencies'] if r.startswith('transformers')))")
pip download -q --no-deps -d .whl "$transformers" fastapi starlette pydantic pydantic-settings python-dotenv \
  annotated-types typing-inspection "typing_extensions>=4.14" opentelemetry-api uvicorn h11 click redis gguf \
  psycopg psycopg-pool httpx httpcore anyio certifi idna py-spy
for version in 3.10 3.11 3.12 3.13; do
  pip download -q --no-deps -d .whl --only-binary=:all: --python-version "$version" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 pydantic-core lmdb hiredis psycopg-binary
done
grep -qx ".gpu-carry/" .git/info/exclude || echo ".gpu-carry/" >> .git/info/exclude
python3 -m benchmarks.gpu_service --write-carry .gpu-carry
ls .whl .gpu-carry
