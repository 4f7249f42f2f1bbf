# `make serve`: set up and run the service on embedded defaults. `make test`: set up and run the tests.
# Both install pyproject's [test] extras (scripts/setup.sh); docker/Dockerfile's production image does not.
PY := .venv/bin/python

.PHONY: setup serve test bench

setup:
	bash scripts/setup.sh

serve: setup
	$(PY) -m statekeeper.cli serve $(ARGS)

# The tests need the [test] extras whatever STATEKEEPER_EXTRAS the caller's environment holds.
test: export STATEKEEPER_EXTRAS = test
test: setup
	bash scripts/install-test-deps.sh
	$(PY) -m pytest $(ARGS)

bench: setup
	$(PY) -m benchmarks.restore_ttft $(ARGS)
