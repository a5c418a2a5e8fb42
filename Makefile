# aip-crewai: `make run` (the demo) and `make test` each set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint test-fast coverage test-realcrews test-inprocess test-matrix test-postgresql check check-tests bench contracts chaos clean

# Test processes of pytest-xdist (`pytest -n`): the suite is mostly waiting on real processes, so more
# workers than the 2 cores of the CI machine pay off. Tests sharing a module's sidecar stay on one worker
# (tests/conftest.py: --dist loadgroup).
TEST_WORKERS ?= 4
XDIST := -n $(TEST_WORKERS) --dist loadgroup
# `bytecode <python>`: byte-compile our sources for that interpreter. pip compiles what it installs, but not an
# editable install's own files; where PYTHONDONTWRITEBYTECODE is set (as on the CI machine) every process would
# otherwise compile the package from source again, and every sidecar job's worker its crew registry
# (docs/operating.md, "Installing under systemd"). Up-to-date files are skipped.
bytecode = $(1) -m compileall -q -j 0 aip_crewai bench tests examples >/dev/null
# `timed <name> <command...>`: run it and print its wall time.
timed = started=$$(date +%s); status=0; $(2) || status=$$?; echo "make $(1): $$(( $$(date +%s) - started )) s (exit $$status)"; exit $$status

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make: installing aip-crewai and its dependencies into $(VENV) (CrewAI is large: the first time takes a minute or two)"
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --progress-bar off -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	@$(call bytecode,$(PY))
	$(PY) -m aip_crewai.examples.demo $(if $(filter 1 yes true,$(WEBHOOKS)),--webhooks)

# The gates (ruff lint and format check, mypy), then the whole suite.
test: $(STAMP)
	@$(call bytecode,$(PY))
	@$(call timed,test,$(MAKE) --no-print-directory lint check && $(PY) -m pytest -q $(XDIST))

# ruff: lint (with import order) and the format check over the package, tests, bench and examples.
lint: $(STAMP)
	$(PY) -m ruff check aip_crewai tests bench examples
	$(PY) -m ruff format --check aip_crewai tests bench examples

# The fast tier: every test that starts no process (marker `processes`: tests/conftest.py sets it on the
# integration and browser suites and on the tests using a process fixture; any other test that forks or
# starts a program fails here, naming the marker). One pytest process: CrewAI is imported once.
test-fast: $(STAMP)
	@$(call bytecode,$(PY))
	@$(call timed,test-fast,AIP_CREWAI_TEST_TIER=fast $(PY) -m pytest -q -m "not processes")

# The fast tier under coverage: a line and branch report of the package (the processes the other tiers start
# are not measured), failing below COVERAGE_FLOOR percent. CI runs it.
COVERAGE_FLOOR ?= 80
coverage: $(STAMP)
	@$(call bytecode,$(PY))
	@$(call timed,coverage,AIP_CREWAI_TEST_TIER=fast $(PY) -m pytest -q -m "not processes" --cov=aip_crewai --cov-branch --cov-report=term:skip-covered --cov-fail-under=$(COVERAGE_FLOOR))

# The real-crew compatibility suite alone (make test runs it too): the example deployment examples/realcrews
# through a real sidecar and host against a fake OpenAI-compatible provider on loopback.
test-realcrews: $(STAMP)
	@$(call bytecode,$(PY))
	$(PY) -m pytest -q -m realcrews tests/realcrews

# The integration tests that run crew jobs (marker sidecar_jobs) again with jobs in the sidecar process
# (--isolation inprocess; the suite's default is process isolation). CI runs it, after make test.
test-inprocess: $(STAMP)
	@$(call bytecode,$(PY))
	@$(call timed,test-inprocess,AIP_CREWAI_ISOLATION=inprocess $(PY) -m pytest -q $(XDIST) -m sidecar_jobs tests/integration tests/realcrews)

# The lowest and the highest supported Python (pyenv's interpreters), each in its own .venv-<version>: the
# type check, the fast tier (every test that starts no process; make test runs the rest on the default
# Python) and the demo's end-to-end test, which starts both processes. A version that is not installed is
# skipped with a line. CI runs it.
MATRIX ?= 3.10 3.13
MATRIX_TESTS ?= -m "not processes"
test-matrix:
	@for v in $(MATRIX); do \
	  py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.* 2>/dev/null | sort -V | tail -1)/bin/python; \
	  if [ ! -x "$$py" ]; then echo "test-matrix: no Python $$v under pyenv; skipped"; continue; fi; \
	  echo "test-matrix: Python $$v ($$py)"; \
	  $(MAKE) --no-print-directory .venv-$$v/.installed PYTHON=$$py VENV=.venv-$$v || exit 1; \
	  $(call bytecode,.venv-$$v/bin/python) || exit 1; \
	  .venv-$$v/bin/python -m mypy || exit 1; \
	  AIP_CREWAI_TEST_TIER=fast .venv-$$v/bin/python -m pytest -q $(MATRIX_TESTS) || exit 1; \
	  .venv-$$v/bin/python -m pytest -q tests/integration/test_demo.py || exit 1; \
	done

# The host-level suites (marker host_processes: every integration and reliability test that starts a host, and
# the real-crew tests of usage, receipts and traces, whose ledger is the host store's)
# again with every host on PostgreSQL (AIP_CREWAI_TEST_STORE=postgresql: a fresh database per host,
# tests/storebackend.py; tests about the SQLite file itself skip). The PostgreSQL-specific tests run in
# make test already. A throwaway cluster from Debian's `postgresql` package in a temporary directory,
# started as the `postgres` user on a loopback port (tests/pgserver.py); without it the tests skip with one
# line. CI runs it.
test-postgresql: $(STAMP)
	@$(call bytecode,$(PY))
	@$(call timed,test-postgresql,AIP_CREWAI_TEST_STORE=postgresql $(PY) -m pytest -q $(XDIST) -m host_processes tests/integration tests/reliability tests/realcrews/test_observing.py tests/realcrews/test_usage.py)

# The type checks alone: the package (strict, pyproject.toml; make test runs it first), then the tests and the
# benchmarks (check-tests).
check: $(STAMP)
	$(PY) -m mypy
	@$(MAKE) --no-print-directory check-tests

# mypy over the tests and the benchmarks (tests/mypy.ini: ordinary checking). Each test folder on its own (the
# shared helpers are the package kits, tests/kits; a folder's own helper modules are imported by bare name and every
# folder has a conftest.py), then the top-level test modules, then bench as a package (bench/__main__.py beside
# bench/__init__.py). MYPYPATH: tests (kits, pgserver, storebackend), every folder whose own helper modules its tests
# import, and the example deployment's modules that tests/realcrews imports. A folder without modules (tests/snapshots:
# committed schemas) is passed over. Stops at the first folder with errors.
TESTS_MYPYPATH := tests:tests/browser:tests/conformance:tests/realcrews:tests/reliability:tests/sidecar:examples/realcrews
TESTS_MYPY = MYPYPATH=$(TESTS_MYPYPATH) $(PY) -m mypy --config-file tests/mypy.ini
check-tests: $(STAMP)
	@for d in tests/*/; do \
	  [ "$$d" = tests/__pycache__/ ] && continue; \
	  ls $$d*.py >/dev/null 2>&1 || continue; \
	  echo "check-tests: $${d%/}"; \
	  $(TESTS_MYPY) $${d%/} || exit 1; \
	done
	@echo "check-tests: tests/*.py" && $(TESTS_MYPY) tests/*.py
	@echo "check-tests: bench" && $(TESTS_MYPY) -p bench

contracts: $(STAMP)
	$(PY) -m aip_crewai.cli contracts --write

bench: $(STAMP)
	@$(call bytecode,$(PY))
	$(PY) -m bench

# Fault injection at scale: AIP_CREWAI_CHAOS_SCALE=N multiplies the trials (prints tried/passed per category).
chaos: $(STAMP)
	@$(call bytecode,$(PY))
	PYTHONPATH=tests $(PY) tests/reliability/chaos.py

clean:
	rm -rf $(VENV) .venv-* .run
	find aip_crewai bench tests examples -name __pycache__ -type d -prune -exec rm -rf {} +
