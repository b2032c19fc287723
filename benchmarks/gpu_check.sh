#!/usr/bin/env bash
# `make gpu-check`: the GPU path in one command, on a bare lent GPU machine as on a workstation (benchmarks/gpu_check.py
# runs the `gpu` tests and the short bench and prints one table). This script finds the Python to run it with:
#   $GPU_CHECK_PYTHON if set; else .venv (`make install PROFILE=gpu`) if it imports the stack; else the machine's
#   python3 (its own CUDA torch) with .gpu-site first on PYTHONPATH, installed here once (pip --target) from the
#   wheels `make gpu-wheels` put in .whl/gpu (carried to a machine that reaches no registry). Not a venv: the lent
#   machines' python3 is itself a venv, whose packages a venv made from it would not see.
# Arguments go to gpu_check.py (--budget SECONDS, --out DIR, --skip-bench, ...). Without CUDA the tests skip and the
# bench runs its CPU smoke: the plumbing (CI runs this in tests/e2e/test_benchmarks.py).
set -euo pipefail
cd "$(dirname "$0")/.."
# colossalai.booster, not colossalai: the booster imports galore_torch and bitsandbytes (a lent H200 once lacked it,
# and every test failed at its first import instead of here)
STACK='import colossalai.booster, transformers, datasets, pydantic, coati_kto'
usable() { command -v "$1" >/dev/null && PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD "$1" -c "$STACK" >/dev/null 2>&1; }
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if usable .venv/bin/python; then
        PY=.venv/bin/python
    elif [ -d .whl/gpu ]; then
        PY=python3
        if ! PYTHONPATH=$PWD/.gpu-site usable "$PY"; then
            echo "gpu-check: installing .whl/gpu into .gpu-site for $("$PY" -c 'import torch; print("torch", torch.__version__)')"
            "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target "$PWD/.gpu-site" .whl/gpu/*
            PYTHONPATH=$PWD/.gpu-site usable "$PY" || { PYTHONPATH=$PWD/.gpu-site:$PWD "$PY" -c "$STACK"; exit 1; }
        fi
        export PYTHONPATH=$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "gpu-check: no Python with the GPU profile: run 'make install PROFILE=gpu', or 'make gpu-wheels' on a" \
            "machine that reaches PyPI and carry .whl/gpu here" >&2
        exit 2
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" benchmarks/gpu_check.py "$@"
