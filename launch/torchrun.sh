#!/usr/bin/env bash
# Train with torchrun: one node, or one call per node for several nodes.
#
#   bash launch/torchrun.sh CONFIG [section.key=value ...]                    # this node only
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash launch/torchrun.sh CONFIG  # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash launch/torchrun.sh CONFIG  # on node 1
#
# Run from any directory: CONFIG may be relative to it; relative paths inside the config (data, outputs) are read
# from the repo root, as in the shipped configs (the script runs there).
# NPROC_PER_NODE defaults to the number of GPUs (2 on a CPU-only machine). Every node must see the same config,
# data and output paths (a shared filesystem); global rank 0 writes the shared files, node-local caches are
# keyed by local rank.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [NNODES=N NODE_RANK=R MASTER_ADDR=A] [NPROC_PER_NODE=N] $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift
# The scripts run from the repo root (below): a config path is first read from where you are, then from there.
if [[ -f $config ]]; then
    config=$(realpath -- "$config")
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$repo/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    default_nproc=$("$python" -c 'import torch; print(torch.cuda.device_count())')
else
    default_nproc=2
fi

nnodes=${NNODES:-1}
args=(--nproc_per_node "${NPROC_PER_NODE:-$default_nproc}")
if [[ $nnodes -eq 1 && -z ${MASTER_ADDR:-} ]]; then
    args+=(--standalone)
else
    args+=(--nnodes "$nnodes" --node_rank "${NODE_RANK:?set NODE_RANK}"
        --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}")
fi

cd "$repo"
# coati_kto.launch is torchrun with the project's stop-signal forwarding and one-line failures.
exec "$python" -m coati_kto.launch "${args[@]}" -m coati_kto train "$config" "$@"
