#!/usr/bin/env bash
# `make gpu-check`: the GPU path in one command, on a bare lent GPU machine as on a workstation (benchmarks/gpu_check.py
# runs the `gpu` tests and the short bench and prints one table). This script finds the Python to run it with:
#   $GPU_CHECK_PYTHON if set; else .venv (`make install PROFILE=gpu`) if it imports the stack; else .venv-gpu,
#   built here once from the wheels `make gpu-wheels` put in .whl/gpu (carried to a machine that reaches no
#   registry), on top of the machine's own CUDA torch (--system-site-packages).
# Arguments go to gpu_check.py (--budget SECONDS, --out DIR, --skip-bench, ...). Without CUDA the tests skip and the
# bench runs its CPU smoke: the plumbing (CI runs this in tests/e2e/test_benchmarks.py).
set -euo pipefail
cd "$(dirname "$0")/.."
STACK='import colossalai, transformers, datasets, pydantic, coati_kto'
usable() { [ -x "$1" ] && PYTHONPATH=. "$1" -c "$STACK" >/dev/null 2>&1; }
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if usable .venv/bin/python; then
        PY=.venv/bin/python
    elif usable .venv-gpu/bin/python; then
        PY=.venv-gpu/bin/python
    elif [ -d .whl/gpu ]; then
        echo "gpu-check: building .venv-gpu from .whl/gpu on $(python3 -c 'import torch; print("torch", torch.__version__)')"
        python3 -m venv --system-site-packages .venv-gpu
        .venv-gpu/bin/pip install -q --no-index --no-deps --no-build-isolation .whl/gpu/*
        .venv-gpu/bin/pip install -q --no-index --no-deps --no-build-isolation -e .
        PY=.venv-gpu/bin/python
        usable "$PY" || { PYTHONPATH=. "$PY" -c "$STACK"; exit 1; }
    else
        echo "gpu-check: no Python with the GPU profile: run 'make install PROFILE=gpu', or 'make gpu-wheels' on a" \
            "machine that reaches PyPI and carry .whl/gpu here" >&2
        exit 2
    fi
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" benchmarks/gpu_check.py "$@"
