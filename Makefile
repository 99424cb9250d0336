# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test test-dist install install-test services lint typecheck bench clean

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

# The distributed path on a runtime-only install: a fresh venv with `pip install .` (no
# test extras), a real worker and dispatch finishing the demo case on PostgreSQL and Redis.
DIST_VENV ?= var/dist-venv
test-dist: services
	rm -rf $(DIST_VENV) var/dist-check
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/pip install --quiet --upgrade pip
	$(DIST_VENV)/bin/pip install --quiet .
	$(DIST_VENV)/bin/python -I scripts/dist_check.py --bin $(DIST_VENV)/bin --repo . \
	    --work var/dist-check

lint: install-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: install-test services
	$(PY) bench/step_overhead.py

clean:
	rm -rf $(VENV) .investigate var build
