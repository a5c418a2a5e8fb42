# aip-crewai: `make run` (the demo) and `make test` each set up .venv themselves.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test check bench contracts chaos clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m examples.demo

test: $(STAMP)
	$(PY) -m mypy
	$(PY) -m pytest -q

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
	rm -rf $(VENV) .run
