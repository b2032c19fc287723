"""The GPU path proven in one command (``make gpu-check``; benchmarks/gpu_check.sh picks the Python): ONE table.

    PYTHONPATH=. python benchmarks/gpu_check.py [--out DIR] [--budget 480] [--skip-bench | --skip-tests]

1. The ``gpu`` tests (``pytest -m gpu`` over :data:`TESTS`, one GPU, NCCL): the step's gradient
   norm on ddp, low_level_zero and hybrid_parallel against a float64 recomputation; the family lifecycle (step-0
   log-probs equal and rewards exactly 0, resume bit-exact, export reload) of Llama, Qwen3 (q/k norms) and Gemma 3
   (sliding windows) under low_level_zero and hybrid_parallel ZeRO-2 bf16; padding-free flex_attention rows
   against padded sdpa in bf16; the fused RMSNorm (``model.fused_norms``) on torch's CUDA kernels; the fused
   rotary embedding (``model.fused_rotary``) in bf16 against transformers' and float64; the one-chunk LM head
   (torch's log-softmax) against the online chunks in bf16.
2. The short bench (benchmarks/gpu_bench.py, unchanged): Llama, hybrid ZeRO-2, tool-use rows, online and cached
   reference (then the compiled case and the padding-free pair while the budget lasts); TRL side by side when
   ``.whl/trl`` is there.
3. One table: each test's outcome and seconds, then per bench case step time, MFU, host syncs and kernels.

At most ``--budget`` seconds (480: a lent device call is 10 minutes, the machine's start and a first HybridAdam
build included); the bench gets what the tests left. Without CUDA the tests skip and the bench runs its CPU smoke
on the online case: the plumbing, which CI runs (tests/e2e/test_benchmarks.py). Exit status 0 when no
test failed and every bench case ran or was left out for time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ("tests/distributed/test_gpu_path.py", "tests/unit/models/test_rotary.py")
BENCH_CASES = (  # gpu_bench runs them in its own order: online and cached, then compiled, then padding-free
    "llama/tool_use/online/hybrid_z2",
    "llama/tool_use/cached/hybrid_z2",
    "llama/tool_use/online/hybrid_z2/compile",
    "llama/tool_use/online/hybrid_z2/free",
    "llama/tool_use/cached/hybrid_z2/free",
)
# Without CUDA (the plumbing, CI): the first, by its whole name (which prefixes the compiled and padding-free ones);
# gpu_bench's own smoke runs every case, the cached one too.
SMOKE_BENCH_CASES = BENCH_CASES[:1]
BENCH_FLOOR_S = 90  # less than this left after the tests: no bench


def run_tests(out: Path, timeout: float) -> tuple[list[dict[str, Any]], float]:
    """The ``gpu`` tests in a subprocess; one row per test case (name, outcome, seconds) from pytest's JUnit XML."""
    report = out / "tests.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "gpu",
        *TESTS,
        f"--junitxml={report}",
        "-p",
        "no:cacheprovider",
    ]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        (out / "tests.log").write_text(proc.stdout + proc.stderr)
    except subprocess.TimeoutExpired:
        return [
            {"name": "gpu tests", "outcome": f"TIMEOUT after {timeout:.0f} s", "seconds": timeout}
        ], timeout
    rows = []
    for case in ET.parse(report).getroot().iter("testcase") if report.exists() else []:
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "FAILED", "error": "ERROR"}.get(tag, "skipped")
                if tag != "skipped":
                    outcome += (
                        ": " + (element.get("message") or "").splitlines()[0][:90]
                        if element.get("message")
                        else ""
                    )
        rows.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0)})
    if not rows:
        rows = [
            {
                "name": "gpu tests",
                "outcome": f"ERROR: no results (pytest exit {proc.returncode})",
                "seconds": 0,
            }
        ]
    return rows, time.perf_counter() - started


def run_bench(out: Path, time_limit: float, smoke: bool) -> dict[str, Any]:
    """benchmarks/gpu_bench.py on the short case list; its JSON report (``cases`` and ``trl`` rows)."""
    report = out / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_bench.py"), "--out", str(out / "bench")]
    cases = ",".join(SMOKE_BENCH_CASES if smoke else BENCH_CASES)
    cmd += ["--cases", cases, "--json", str(report), "--time-limit", f"{time_limit:.0f}"]
    trl = ROOT / ".whl" / "trl"
    cmd += ["--trl-wheels", str(trl)] if trl.is_dir() and not smoke else ["--skip-trl"]
    cmd += ["--smoke"] if smoke else ["--steps", "4", "--warmup", "2", "--profile-steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=time_limit + 120)
    (out / "bench.log").write_text(proc.stdout + proc.stderr)
    if not report.exists():
        return {
            "error": f"gpu_bench exit {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}",
            "cases": [],
        }
    return json.loads(report.read_text())


def _cell(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(tests: list[dict[str, Any]], bench: dict[str, Any] | None, device: str) -> str:
    """The one table: the tests' rows, then the bench's (step s, MFU, syncs and kernels per step)."""
    lines = [f"gpu-check on {device}", f"{'test':<64}  {'outcome':<10}  seconds"]
    for row in tests:
        lines.append(f"{row['name']:<64}  {row['outcome']:<10}  {row['seconds']:.1f}")
    if bench is None:
        lines.append("bench: not run")
        return "\n".join(lines)
    lines.append(f"{'bench case':<64}  {'step_s':<8}  {'MFU':<6}  {'syncs':<6}  kernels")
    for row in bench.get("cases", []) + bench.get("trl", []):
        if "step_s" not in row:
            lines.append(f"{row['case']:<64}  {row.get('skipped') or row.get('error') or 'not run'}"[:150])
            continue
        cells = (_cell(row.get(k), s) for k, s in (("mfu", ".1%"), ("syncs", ".1f"), ("kernels", ".0f")))
        lines.append(
            f"{row['case']:<64}  {row['step_s']:<8.4f}  " + "  ".join(f"{c:<6}" for c in cells).rstrip()
        )
    if "error" in bench:
        lines.append(f"bench: {bench['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/gpu_check"), help="logs, JUnit XML, bench JSON")
    p.add_argument("--budget", type=float, default=480, help="seconds for tests and bench together")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-bench", action="store_true", help="the tests only")
    # a second device call: the whole budget to the bench (the tests left the first one 130 s on an H200)
    skip.add_argument("--skip-tests", action="store_true", help="the bench only")
    args = p.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}" if cuda else "CPU (no CUDA: smoke)"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()
    tests = [] if args.skip_tests else run_tests(args.out, args.budget - BENCH_FLOOR_S)[0]
    left = args.budget - (time.perf_counter() - started)
    bench = None
    if not args.skip_bench and left >= BENCH_FLOOR_S:
        bench = run_bench(args.out, left - 30, smoke=not cuda)
    print("\n" + table(tests, bench, device), flush=True)
    print(f"total {time.perf_counter() - started:.1f} s; logs in {args.out}")
    failed = [t for t in tests if t["outcome"].startswith(("FAILED", "ERROR", "TIMEOUT"))]
    bench_failed = bench is not None and (
        "error" in bench or any("error" in r for r in bench.get("cases", []))
    )
    return 1 if failed or bench_failed else 0


if __name__ == "__main__":
    sys.exit(main())
