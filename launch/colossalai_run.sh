#!/usr/bin/env bash
# Train with `colossalai run` on this node, or on every node of a hostfile.
#
#   bash launch/colossalai_run.sh CONFIG [section.key=value ...]                 # this node, NPROC_PER_NODE ranks
#   HOSTFILE=launch/hostfile.example bash launch/colossalai_run.sh CONFIG ...    # every host in the hostfile
#
# Multi-node: colossalai run SSHes into each host (password-less SSH, same repo path and .venv on every host),
# runs `cd <this dir> && export <this environment> && torchrun ...` there. Set MASTER_ADDR to an address the
# other nodes reach (not 127.0.0.1) and, if the hosts have several interfaces, NCCL_SOCKET_IFNAME /
# GLOO_SOCKET_IFNAME to the one they share (see README, "Multi-node").
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [HOSTFILE=...] [NPROC_PER_NODE=N] $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_bin=${VENV_BIN:-$repo/.venv/bin}
# The remote shells find torchrun by PATH: the venv's bin must come first.
export PATH="$venv_bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# colossalai run re-exports the environment as export K="V" in one bash line: values holding $ or quotes break
# it. make's variables are the usual culprits (MAKEOVERRIDES="${-*-command-variables-*-}").
unset MAKEOVERRIDES MAKEFLAGS MFLAGS

if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    default_nproc=$(python -c 'import torch; print(torch.cuda.device_count())')
else
    default_nproc=2
fi
nproc=${NPROC_PER_NODE:-$default_nproc}
port=${MASTER_PORT:-29500}

args=(--nproc_per_node "$nproc" --master_port "$port")
if [[ -n ${HOSTFILE:-} ]]; then
    args+=(--hostfile "$HOSTFILE" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first host address}")
fi

cd "$repo"
exec colossalai run "${args[@]}" -m coati_kto train "$config" "$@"
