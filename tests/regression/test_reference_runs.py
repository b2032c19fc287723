"""Same seed, same numbers: four fixed runs (ddp fp32, hybrid ZeRO-2 bf16, cached reference, LoRA) against the
numbers recorded in ``reference_runs.json`` (see ``reference_runs.py``).

Bit for bit only where this machine's kernel key (torch and transformers builds, CPU vendor and model, the ISA
extensions MKL and oneDNN dispatch on, threads, kernel-capping environment: ``coati_kto.testing.machine``) equals
the one the file was recorded on. Anywhere else the same code legitimately rounds differently in the last bits, so
the runs are compared within rounding (fp32 1e-5 relative, bf16 runs 2e-2) and by the weights' sum instead of
their hash. Each test prints which path it took and why (``pytest -rA`` or a failure shows it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from reference_runs import REFERENCE_FILE, RUNS, machine, run_reference

from coati_kto.testing.machine import key_differences

RECORDED = json.loads(REFERENCE_FILE.read_text())
KEY_DIFFERENCES = key_differences(RECORDED["machine"], machine())
SAME_MACHINE = not KEY_DIFFERENCES


def comparison_path() -> str:
    """One line: which comparison the runs get on this machine, and why."""
    if SAME_MACHINE:
        return "bit-exact: this machine's kernel key equals the recording's"
    return "within rounding: kernel key differs from the recording's (" + "; ".join(KEY_DIFFERENCES) + ")"


def _close(a: float, b: float, rel: float, scale: float = 0.0) -> bool:
    """``a`` and ``b`` within ``rel`` of the larger of them or of ``scale``, the magnitude the value rounds at."""
    return math.isclose(a, b, rel_tol=rel, abs_tol=rel * max(scale, 1e-2))


def _rounding_scale(record: dict[str, float], key: str) -> float:
    """Rewards, margins and the KL estimate are differences of summed log-probs (tens of nats here): they round as
    those sums do, not as their own value, which is 0 up to that rounding where policy and reference agree (step
    0; a cached reference's step 1). The mean logit (logits/) is a mean of logits of order 1 that nearly cancel
    (-0.005 on the tiny model): it rounds as they do. Other metrics round at their own magnitude (0 here:
    ``_close`` takes it)."""
    if "/logits/" in key:
        return 1.0
    if "rewards" not in key and "kl" not in key:
        return 0.0
    return max([abs(v) for k, v in record.items() if "/logps/" in k], default=0.0)


@pytest.mark.parametrize("name", list(RUNS))
def test_run_matches_reference(name: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    expected = RECORDED["runs"][name]
    print(f"{name}: {comparison_path()}")
    got = run_reference(name, tmp_path / name, tiny_model_dir)
    if SAME_MACHINE:
        assert got["history"] == expected["history"]
        assert got["weights"]["sha256"] == expected["weights"]["sha256"]
        return
    rel = 2e-2 if "bf16" in name else 1e-5
    assert [sorted(h) for h in got["history"]] == [sorted(h) for h in expected["history"]]
    for g, e in zip(got["history"], expected["history"], strict=True):
        bad = {k: (g[k], e[k]) for k in e if not _close(g[k], e[k], rel, _rounding_scale(e, k))}
        assert not bad, f"{name} step {e['step']}: {bad}"
    assert _close(got["weights"]["sum"], expected["weights"]["sum"], rel)


def test_kernel_key_decides_the_path() -> None:
    """A recording from another CPU model or ISA set, or with a capped oneDNN, never gets the bit-exact path."""
    here = machine()
    assert key_differences(here, dict(here)) == []
    for field, other in [
        ("cpu_model", "Intel(R) Xeon(R) Platinum 8480+"),
        ("isa_flags", [*here["isa_flags"], "amx_bf16"]),
        ("kernel_env", {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
        ("threads", here["threads"] + 1),
    ]:
        assert key_differences({**here, field: other}, here) == [
            f"{field}: recorded {other!r}, here {here[field]!r}"
        ]
    old_style = {k: here[k] for k in ("torch", "transformers", "cpu_capability", "machine")}
    assert any(d.startswith("cpu_model: not recorded") for d in key_differences(old_style, here))
