"""What decides whether a float computation repeats bit for bit on another CPU machine.

Three kernel libraries run a CPU step, and each dispatches on something different:

- ATen's own vectorised kernels (elementwise, reductions, softmax) on ``torch.backends.cpu.get_cpu_capability()``
  (DEFAULT / AVX2 / AVX512, or what ``ATEN_CPU_CAPABILITY`` caps it to);
- MKL (fp32 GEMM) on the CPU's vendor and model as well as its instruction sets: it takes other code paths on AMD
  than on Intel with the same AVX-512 flags (``MKL_ENABLE_INSTRUCTIONS`` caps it);
- oneDNN (bf16 matmuls, some fused ops) on the ISA extensions it finds: AVX512-BF16, AVX512-VNNI, AMX tiles
  (``ONEDNN_MAX_CPU_ISA`` caps it).

Summation order inside those kernels also depends on the thread count. So a recorded result is reproduced bit for
bit only where all of ``kernel_key()`` matches; two machines with the same ``cpu_capability`` (the key this project
used before) can differ from the first step, as an AMX Xeon and an AVX-512 EPYC do.

``python -m coati_kto.testing.machine`` prints the key (``.ci/run`` does, so a failure can be tied to a machine).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

# The /proc/cpuinfo flags that MKL and oneDNN dispatch on (x86-64); others do not choose kernels.
KERNEL_ISA_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512dq",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
# Environment variables that cap or change the kernels the libraries pick.
KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DEBUG_CPU_TYPE",
    "MKL_CBWR",
)


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty off Linux): vendor_id, model name, flags, ..."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def kernel_key(threads: int | None = None) -> dict[str, Any]:
    """Everything that picks the CPU kernels a run uses; ``threads`` is the intra-op thread count of the
    processes that computed (default: this process's)."""
    import torch
    import transformers

    info = cpu_info()
    flags = set(info.get("flags", "").split())
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_vendor": info.get("vendor_id", platform.processor()),
        "cpu_model": info.get("model name", ""),
        "cpu_family_model_stepping": "/".join(info.get(k, "?") for k in ("cpu family", "model", "stepping")),
        "isa_flags": [f for f in KERNEL_ISA_FLAGS if f in flags],
        "threads": torch.get_num_threads() if threads is None else threads,
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
    }


def key_differences(recorded: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Why a result recorded under ``recorded`` may not repeat bit for bit ``here`` (empty: it should)."""
    out = []
    for name in sorted(set(recorded) | set(here)):
        if name not in recorded:
            out.append(f"{name}: not recorded (here {here[name]!r})")
        elif recorded.get(name) != here.get(name):
            out.append(f"{name}: recorded {recorded[name]!r}, here {here.get(name)!r}")
    return out


if __name__ == "__main__":
    print(json.dumps(kernel_key(), indent=1))
