# aip-crewai: `make run` (the demo) and `make test` each set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test test-inprocess test-matrix test-postgresql check bench contracts chaos clean

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

# The sidecar integration tests again with jobs in the sidecar process (--isolation inprocess; the
# suite's default is process isolation). CI runs it once, beside make test.
test-inprocess: $(STAMP)
	AIP_CREWAI_ISOLATION=inprocess $(PY) -m pytest -q tests/integration

# The suite on the lowest and the highest supported Python, each in its own .venv-<version>
# (pyenv's interpreters; a version that is not installed is skipped with a line). CI runs it.
MATRIX ?= 3.10 3.13
test-matrix:
	@for v in $(MATRIX); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.* 2>/dev/null | sort -V | tail -1)/bin/python; \
	  if [ ! -x "$$py" ]; then echo "test-matrix: no Python $$v under pyenv; skipped"; continue; fi; \
	  echo "test-matrix: Python $$v ($$py)"; \
	  $(MAKE) --no-print-directory test PYTHON=$$py VENV=.venv-$$v || exit 1; \
	done

# The PostgreSQL tests (make test runs them too), then the integration and reliability suites with every
# host they start on PostgreSQL (AIP_CREWAI_TEST_STORE=postgresql: a fresh database per host, tests/storebackend.py;
# tests about the SQLite file itself skip). A throwaway cluster from Debian's `postgresql` package in a
# temporary directory, started as the `postgres` user on a loopback port (tests/pgserver.py); without it
# the tests skip with one line. CI runs it.
test-postgresql: $(STAMP)
	$(PY) -m pytest -q -k "postgresql or postgres"
	AIP_CREWAI_TEST_STORE=postgresql $(PY) -m pytest -q tests/integration tests/reliability

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
