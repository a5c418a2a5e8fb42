# aip-crewai: `make run` (the demo) and `make test` each set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-realcrews test-inprocess test-matrix test-postgresql check bench contracts chaos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make: installing aip-crewai and its dependencies into $(VENV) (CrewAI is large: the first time takes a minute or two)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m aip_crewai.examples.demo

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q

# The real-crew compatibility suite alone (make test runs it too): the example deployment examples/realcrews
# through a real sidecar and host against a fake OpenAI-compatible provider on loopback.
test-realcrews: $(STAMP)
	$(PY) -m pytest -q -m realcrews tests/realcrews

# The integration tests that run crew jobs (marker sidecar_jobs) again with jobs in the sidecar process
# (--isolation inprocess; the suite's default is process isolation). CI runs it, after make test.
test-inprocess: $(STAMP)
	AIP_CREWAI_ISOLATION=inprocess $(PY) -m pytest -q -m sidecar_jobs tests/integration tests/realcrews

# The lowest and the highest supported Python (pyenv's interpreters), each in its own .venv-<version>: the
# type check and every test but the process-level suites (markers integration and browser; make test runs
# those on the default Python). The demo's end-to-end test and the hostile-input tests still start both
# processes on each. A version that is not installed is skipped with a line. CI runs it.
MATRIX ?= 3.10 3.13
MATRIX_TESTS ?= -m "not integration and not browser"
test-matrix:
	@for v in $(MATRIX); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.* 2>/dev/null | sort -V | tail -1)/bin/python; \
	  if [ ! -x "$$py" ]; then echo "test-matrix: no Python $$v under pyenv; skipped"; continue; fi; \
	  echo "test-matrix: Python $$v ($$py)"; \
	  $(MAKE) --no-print-directory .venv-$$v/.installed PYTHON=$$py VENV=.venv-$$v || exit 1; \
	  .venv-$$v/bin/python -m mypy || exit 1; \
	  .venv-$$v/bin/python -m pytest -q $(MATRIX_TESTS) || exit 1; \
	done

# The host-level suites (marker host_processes: every integration and reliability test that starts a host)
# again with every host on PostgreSQL (AIP_CREWAI_TEST_STORE=postgresql: a fresh database per host,
# tests/storebackend.py; tests about the SQLite file itself skip). The PostgreSQL-specific tests run in
# make test already. A throwaway cluster from Debian's `postgresql` package in a temporary directory,
# started as the `postgres` user on a loopback port (tests/pgserver.py); without it the tests skip with one
# line. CI runs it.
test-postgresql: $(STAMP)
	AIP_CREWAI_TEST_STORE=postgresql $(PY) -m pytest -q -m host_processes tests/integration tests/reliability

# The type check alone (make test runs it first).
check: $(STAMP)
	$(PY) -m mypy

contracts: $(STAMP)
	$(PY) -m aip_crewai.cli contracts --write

bench: $(STAMP)
	$(PY) -m bench

# Fault injection at scale: AIP_CREWAI_CHAOS_SCALE=N multiplies the trials (prints tried/passed per category).
chaos: $(STAMP)
	$(PY) tests/reliability/chaos.py

clean:
	rm -rf $(VENV) .venv-* .run
