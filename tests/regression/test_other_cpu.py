"""The suite does not depend on the CPU it runs on: the tests that assert exact or near-exact numbers, run again
with oneDNN, MKL and ATen capped to AVX2 (another machine's kernels on this one), pass.

The child pytest sees a kernel key that differs from ``reference_runs.json``'s (its ``kernel_env``), so the
regression run takes the within-rounding path and must say so; the fp32-router test holds its tolerance for
the cached reference and exact 0 for the online one, and the bf16 step-0 parity stays exact (same code, same
kernels for policy and reference, whatever they are).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coati_kto.testing.machine import cpu_info

TESTS = Path(__file__).resolve().parents[1]
CAPPED_TO_AVX2 = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}
CHOSEN = [
    "tests/regression/test_reference_runs.py::test_run_matches_reference[hybrid_zero2_bf16]",
    # Its step-0 rewards and step-1 KL are 0 up to rounding (the cache is scored in its own passes): they must
    # compare at the log-probs' rounding (failed at 1.9e-7 against 0 before)
    "tests/regression/test_reference_runs.py::test_run_matches_reference[cached_reference]",
    "tests/distributed/test_fp32_routers.py",
    "tests/distributed/test_precision.py",
]


@pytest.mark.skipif("avx2" not in cpu_info().get("flags", "").split(), reason="needs an x86-64 CPU with AVX2")
def test_exact_tests_pass_on_avx2_kernels(tmp_path: Path) -> None:
    env = {**os.environ, **CAPPED_TO_AVX2}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rP", "-p", "no:cacheprovider", "--basetemp", str(tmp_path)]
    done = subprocess.run(
        [*cmd, *CHOSEN], cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=1800
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "within rounding: kernel key differs" in out and "ONEDNN_MAX_CPU_ISA" in out, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 5 and " failed" not in out, out[-2000:]
