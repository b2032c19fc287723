# The README's two commands: `make quickstart` and `make test`. Both create .venv in the repo root when it is
# missing or its pinned requirements changed (a stamp file records the hash), and skip the install otherwise.
# PROFILE=cpu (default: requirements/cpu.txt) or PROFILE=gpu (requirements/gpu.txt: a CUDA torch in range).
SHELL := /bin/bash
PYTHON ?= $(if $(filter gpu,$(PROFILE)),python3,python3.11)
PROFILE ?= cpu
VENV ?= .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements/$(PROFILE).txt requirements/common.txt setup.py | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(PROFILE)-$(REQ_HASH)

.PHONY: install quickstart test test-fast test-all lint format bench gpu-check gpu-wheels

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip install -q --upgrade pip
	@test -f requirements/$(PROFILE).txt || { echo "PROFILE=$(PROFILE): no requirements/$(PROFILE).txt (cpu or gpu)"; exit 2; }
	$(PY) -m pip install -q -r requirements/$(PROFILE).txt
	# colossalai 0.5.0's metadata pins torch<=2.5.1; it runs on torch 2.13 (see docs/installing.md), so no deps here.
	$(PY) -m pip install -q --no-deps colossalai==0.5.0
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -c "import colossalai, coati_kto, transformers; print('installed colossalai', colossalai.__version__)"
	touch $@

quickstart: $(STAMP)
	$(PY) applications/quickstart/run.py $(QUICKSTART_ARGS)

# Two pytest-xdist workers (TEST_WORKERS=0: one process), each running a whole file at a time, the longest files
# first (tests/conftest.py LONGEST_FIRST): a file's module fixtures are built once, and the drills' clusters are
# never up twice. On 2 cores the serial suite left a quarter of the CPU idle (launches waiting on each other).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The 25 slowest tests close the log, so a CI run shows where its time went.
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25 tests -m "not sweep"

# The inner loop, under 5 minutes on 2 cores: tests/unit and the `smoke` tests (one or two per area of the
# distributed, regression and e2e folders; docs/testing.md lists them).
test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=10 tests -m "(smoke or not (distributed or e2e or drill)) and not sweep"

# Also the whole family sweep (tests/distributed/test_family_sweep.py: every causal-LM type, about an hour on 2 cores).
test-all: $(STAMP)
	$(PY) -m pytest -q tests

# Every benchmark's smoke mode (tiny sizes, CPU), its printed figures checked: tests/e2e/test_benchmarks.py.
bench: $(STAMP)
	$(PY) -m pytest -q tests/e2e/test_benchmarks.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# The GPU path in one command (benchmarks/gpu_check.sh): the `gpu` tests, then the short bench, one table. On a
# machine without CUDA the tests skip and the bench runs its CPU smoke (the plumbing; CI runs it in a test).
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_ARGS)

# The GPU profile as wheels in .whl/gpu for a GPU machine that reaches no registry (benchmarks/gpu_wheels.sh).
gpu-wheels: $(STAMP)
	PY=$(PY) bash benchmarks/gpu_wheels.sh
