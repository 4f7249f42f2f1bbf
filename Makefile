# `make serve`: set up and run the service on embedded defaults. `make test`: set up and run the tests.
PY := .venv/bin/python

.PHONY: setup serve test bench

setup:
	bash scripts/setup.sh

serve: setup
	$(PY) -m statekeeper.cli serve $(ARGS)

test: setup
	bash scripts/install-test-deps.sh
	$(PY) -m pytest $(ARGS)

bench: setup
	$(PY) benchmarks/restore_ttft.py $(ARGS)
