#!/usr/bin/env bash
# Train with `colossalai run` on this node, or on every node of a hostfile.
#
#   bash launch/colossalai_run.sh CONFIG [section.key=value ...]                 # this node, NPROC_PER_NODE ranks
#   HOSTFILE=launch/hostfile.example bash launch/colossalai_run.sh CONFIG ...    # every host in the hostfile
#
# Run from any directory: CONFIG may be relative to it; relative paths inside the config (data, outputs) are read
# from the repo root, as in the shipped configs (the script runs there).
# Multi-node: colossalai run SSHes into each host (password-less SSH, same repo path and .venv on every host),
# runs `cd <this dir> && export <this environment> && torchrun ...` there. Set MASTER_ADDR to an address the
# other nodes reach (not 127.0.0.1) and, if the hosts have several interfaces, NCCL_SOCKET_IFNAME /
# GLOO_SOCKET_IFNAME to the one they share (see docs/launching.md, "Multi-node").
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: [HOSTFILE=...] [NPROC_PER_NODE=N] $0 CONFIG [section.key=value ...]" >&2
    exit 2
fi
config=$1
shift
# The scripts run from the repo root (below): a config path is first read from where you are, then from there.
if [[ -f $config ]]; then
    config=$(realpath -- "$config")
fi

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv_bin=${VENV_BIN:-$repo/.venv/bin}
# The remote shells find torchrun by PATH: launch/bin/torchrun (coati_kto.launch) first, then the venv's bin.
export PATH="$repo/launch/bin:$venv_bin:$PATH"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# colossalai run re-exports the environment as export K="V" in one bash line: values holding $ or quotes break
# it. make's variables are the usual culprits (MAKEOVERRIDES="${-*-command-variables-*-}").
unset MAKEOVERRIDES MAKEFLAGS MFLAGS
# That line is also sent over SSH and printed whole when a node fails: secrets must not be in it. Variables
# whose names contain TOKEN, KEY, SECRET, PASSWORD, PASSWD or CREDENTIAL, or have AUTH, OAUTH, AUTHORIZATION, PASS
# PWD or PAT as a part between underscores (not GIT_AUTHOR_NAME), any case, or whose value holds a URL's login
# (postgres://user:pw@host, https://TOKEN@host), are not passed on, except the paths and settings below (the same rule as
# coati_kto.parallel.launch_env.unexportable; SSH_AUTH_SOCK: colossalai run's own SSH uses the agent); credentials
# reach the nodes as files instead (docs/operations.md, "Credentials").
url_login='://[^/@[:space:]:]*:[^/@[:space:]]*@|https?://[^/@[:space:]:]+@'
dropped=()
for name in $(compgen -e); do
    case ${name^^} in
        TOKENIZERS_PARALLELISM | SSH_AUTH_SOCK | HF_TOKEN_PATH | GOOGLE_APPLICATION_CREDENTIALS) ;;
        AWS_SHARED_CREDENTIALS_FILE | PWD) ;;
        *TOKEN* | *KEY* | *SECRET* | *PASSWORD* | *PASSWD* | *CREDENTIAL*)
            dropped+=("$name")
            unset "$name"
            ;;
        *)
            case _${name^^}_ in
                *_AUTH_* | *_OAUTH_* | *_AUTHORIZATION_* | *_PASS_* | *_PWD_* | *_PAT_*)
                    dropped+=("$name")
                    unset "$name"
                    ;;
                *)
                    if [[ ${!name} =~ $url_login ]]; then
                        dropped+=("$name")
                        unset "$name"
                    fi
                    ;;
            esac
            ;;
    esac
done
if [[ ${#dropped[@]} -gt 0 ]]; then
    echo "colossalai_run.sh: not passed to the nodes (secret-looking names): ${dropped[*]}" >&2
fi

nproc=${NPROC_PER_NODE:-}
if [[ -z $nproc ]]; then # asked only without NPROC_PER_NODE: the check imports torch (~2 CPU-s)
    if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
        nproc=$(python -c 'import torch; print(torch.cuda.device_count())')
    else
        nproc=2
    fi
fi
port=${MASTER_PORT:-29500}

args=(--nproc_per_node "$nproc" --master_port "$port")
if [[ -n ${HOSTFILE:-} ]]; then
    # Read from where you are, as CONFIG (the launch runs from the repo root, below).
    if [[ ! -f $HOSTFILE ]]; then
        echo "colossalai_run.sh: HOSTFILE $HOSTFILE: no such file (from $PWD)" >&2
        exit 2
    fi
    args+=(--hostfile "$(realpath -- "$HOSTFILE")")
    args+=(--master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first host address}")
fi

cd "$repo"
# In its own session, so that Ctrl-C reaches only this script, which forwards it (and SIGTERM, SIGUSR1) to this
# node's coati_kto.launch once: its ranks vote, and every rank of every node stops after the same step.
# coati_kto.colossalai_launch is `colossalai run` that stops waiting on the other nodes 30 s after one failed.
setsid python -m coati_kto.colossalai_launch "${args[@]}" -m coati_kto train "$config" "$@" &
launcher=$!
# shellcheck disable=SC2329  # called from the traps
forward() { pkill "-$1" -s "$launcher" -f "coati_kto[.]launch" || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward USR1' USR1
while :; do
    status=0
    wait "$launcher" || status=$?
    kill -0 "$launcher" 2>/dev/null || break # a trapped signal interrupted wait: keep waiting
done
exit "$status"
