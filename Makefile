# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test install install-test services lint typecheck bench bench-report clean

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

bench: install-test services
	$(PY) bench/step_overhead.py

bench-report: install-test services
	$(PY) bench/report_render.py

clean:
	rm -rf $(VENV) .investigate var
