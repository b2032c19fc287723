"""Kernels, bytes per parameter and host syncs per optimizer step (coati_kto.testing.kernels), for the benches:
a counted training run, the same on another git revision (a temporary worktree), and the before/after table.

Used by gpu_bench.py (``--smoke``, and beside the CUDA profile on a GPU) and step_bench.py (``--counts``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COUNTER_FILES = tuple(
    f"coati_kto/testing/{name}.py" for name in ("kernels", "syncs", "attention_paths", "compiled", "op_cost")
)


def counted_run(run: Callable[[], Any], params: int) -> dict[str, Any]:
    """``run()`` (a whole training run of at least 2 optimizer steps) under the counter; the figures per
    optimizer step, averaged over the steady steps (each from the previous step's end to its own: the first
    step's set-up and what follows the last step are left out)."""
    from coati_kto.testing.kernels import CATEGORIES, KernelCounter

    with KernelCounter(steps=True) as counter:
        run()
    windows = counter.windows[:-1]  # the last: after the last step (export, clean-up)
    if not windows:
        return {"count_error": "fewer than 2 optimizer steps"}
    steps = [w.summary(params) for w in windows]
    n = len(steps)

    def mean(get: Callable[[dict], float]) -> float:
        return sum(get(s) for s in steps) / n

    categories = {
        c: {k: mean(lambda s, c=c, k=k: s["categories"][c][k]) for k in ("kernels", "bytes_per_param")}
        for c in CATEGORIES
    }
    keys = ("kernels", "bytes_per_param", "non_matmul_bytes_per_param", "grad_path_bytes_per_param", "syncs")
    out = {f"count_{k}": mean(lambda s, k=k: s[k]) for k in keys}
    out.update(
        count_categories=categories,
        count_steps=n,
        count_syncs_by_place=steps[-1]["syncs_by_place"],
        count_attention=steps[-1]["attention"],
        count_params=params,
    )
    return out


def baseline_results(rev: str, argv: list[str]) -> list[dict[str, Any]]:
    """The RESULT lines of ``python *argv`` run on git revision ``rev`` of this checkout: a temporary worktree
    holding ``rev`` with this tree's counter files (testing code only) copied in; a script of this checkout
    (``argv[0]``) runs as that revision has it."""
    tmp = Path(tempfile.mkdtemp(prefix="coati_baseline_"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    try:
        for name in COUNTER_FILES:
            shutil.copyfile(ROOT / name, tree / name)
        script = Path(argv[0]).resolve()
        if script.is_relative_to(ROOT):  # the bench as it was at ``rev`` (its cases, its config keys)
            argv = [str(tree / script.relative_to(ROOT)), *argv[1:]]
        # The caller's process group (gpu_bench --smoke runs its cases in-process) holds its port: a fresh one.
        dist_env = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        env = {k: v for k, v in os.environ.items() if k not in dist_env}
        env["PYTHONPATH"] = str(tree)
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=str(tree))
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return [{"case": "baseline", "error": " | ".join(tail)[:300]}]
        return [json.loads(line.removeprefix("RESULT ")) for line in lines]
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def _cell(result: dict[str, Any] | None, get: Callable[[dict], float], spec: str) -> str:
    if result is None or "count_kernels" not in result:
        return "n/a"
    return format(get(result), spec)


def count_table(results: list[dict[str, Any]], before: dict[str, dict[str, Any]] | None = None) -> str:
    """Per case: per category kernels and bytes per parameter per optimizer step, totals, syncs, attention paths;
    ``before`` (case -> result): a before column and the after/before ratio of the totals."""
    from coati_kto.testing.kernels import CATEGORIES

    lines = []
    for r in results:
        if "count_error" in r:
            lines.append(f"{r['case']}: not counted: {r['count_error']}")
        if "count_kernels" not in r:
            continue
        b = (before or {}).get(r["case"])
        head = f"{r['case']}: per optimizer step ({r['count_params'] / 1e6:.3f}M parameters)"
        lines.append(head + ("; before -> after" if before is not None else ""))
        lines.append(f"  {'category':<34}{'kernels':>18}{'bytes/param':>24}")
        rows = [(c, lambda x, c=c: x["count_categories"][c]) for c in CATEGORIES]
        for name, get in rows:
            k = _cell(r, lambda x, get=get: get(x)["kernels"], ".0f")
            bp = _cell(r, lambda x, get=get: get(x)["bytes_per_param"], ".1f")
            if before is not None:
                k = _cell(b, lambda x, get=get: get(x)["kernels"], ".0f") + " -> " + k
                bp = _cell(b, lambda x, get=get: get(x)["bytes_per_param"], ".1f") + " -> " + bp
            lines.append(f"  {name:<34}{k:>18}{bp:>24}")
        for key, title, spec in (
            ("count_kernels", "kernels, total", ".0f"),
            ("count_bytes_per_param", "bytes/param, total", ".1f"),
            ("count_non_matmul_bytes_per_param", "bytes/param, not model matmuls", ".1f"),
            ("count_grad_path_bytes_per_param", "bytes/param, gradient+optimizer", ".1f"),
            ("count_syncs", "host syncs (as CUDA counts)", ".1f"),
        ):
            now = _cell(r, lambda x, key=key: x[key], spec)
            if before is not None:
                was = _cell(b, lambda x, key=key: x[key], spec)
                ratio = f"  ({r[key] / b[key]:.2f}x)" if b and "count_kernels" in b and b[key] else ""
                now = f"{was} -> {now}{ratio}"
            lines.append(f"  {title:<34}{now:>42}")
        lines.append(f"  attention per pass: {'; '.join(r['count_attention'])}")
        if r["count_syncs_by_place"]:
            lines.append(f"  syncs at: {r['count_syncs_by_place']}")
    return "\n".join(lines)
