# The README's two commands: `make quickstart` and `make test`. Both create .venv in the repo root when it is
# missing or its pinned requirements changed (a stamp file records the hash), and skip the install otherwise.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements/cpu.txt requirements/common.txt setup.py | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(REQ_HASH)

.PHONY: install quickstart test test-all lint format bench

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	# colossalai 0.5.0's metadata pins torch<=2.5.1; it runs on torch 2.13 (see docs/installing.md), so no deps here.
	$(PY) -m pip install -q --no-deps colossalai==0.5.0
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import colossalai, coati_kto, transformers; print('installed colossalai', colossalai.__version__)"
	touch $@

quickstart: $(STAMP)
	$(PY) applications/quickstart/run.py $(QUICKSTART_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q tests -m "not sweep"

# Also the whole family sweep (tests/distributed/test_family_sweep.py: every causal-LM type, hours on 2 cores).
test-all: $(STAMP)
	$(PY) -m pytest -q tests

# Every benchmark's smoke mode (tiny sizes, CPU), its printed figures checked: tests/e2e/test_benchmarks.py.
bench: $(STAMP)
	$(PY) -m pytest -q tests/e2e/test_benchmarks.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .
