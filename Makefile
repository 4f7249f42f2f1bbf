# `make serve`: set up and run the service on embedded defaults. `make test`: set up and run the tests.
# Both install pyproject's [test] extras (scripts/setup.sh); docker/Dockerfile's production image does not.
PY := .venv/bin/python

.PHONY: setup serve test test-gpu bench

setup:
	bash scripts/setup.sh

serve: setup
	$(PY) -m statekeeper.cli serve $(ARGS)

# The tests need the [test] extras whatever STATEKEEPER_EXTRAS the caller's environment holds.
test: export STATEKEEPER_EXTRAS = test
test: setup
	bash scripts/install-test-deps.sh
	$(PY) -m pytest $(ARGS)

# The GPU suite and the GPU restore benchmark, where a CUDA GPU is, with a python whose torch has CUDA
# (GPU_PY; the project's other requirements installed beside it): tests marked cuda, then
# benchmarks/gpu_restore.py's quick run. BENCHMARKS.md records what they showed.
GPU_PY ?= python3
test-gpu:
	$(GPU_PY) -m pytest -m cuda tests/gpu -q $(ARGS)
	$(GPU_PY) -m benchmarks.gpu_restore --quick

bench: setup
	$(PY) -m benchmarks.restore_ttft $(ARGS)
