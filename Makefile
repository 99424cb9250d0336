# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test install install-test services lint typecheck bench bench-env clean

# The benchmarks' own environment: LangGraph, the reference of bench/step_overhead.py,
# is never a dependency of the engine.
BENCH_VENV ?= .venv-bench
# Redis database the benchmarks use as broker; it is FLUSHED.
BENCH_BROKER_DB ?= 6

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	$(VENV)/bin/investigate demo

services:
	bash scripts/ensure-services.sh

test: install-test services
	$(PY) -m pytest -q

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet langgraph langgraph-checkpoint-sqlite
	touch $@

bench-env: $(BENCH_VENV)/.installed

# Every benchmark of issue 13; each prints its figures with the target beside them.
bench: install-test services bench-env
	uptime
	$(PY) bench/long_case.py
	$(PY) bench/step_overhead.py --broker-db $(BENCH_BROKER_DB) --bench-python $(BENCH_VENV)/bin/python
	$(PY) bench/throughput.py --broker-db $(BENCH_BROKER_DB)
	uptime

clean:
	rm -rf $(VENV) $(BENCH_VENV) .investigate var
