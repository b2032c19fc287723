"""The install profiles resolve: requirements/gpu.txt's pins go together, checked on the CPU.

Every pin of the GPU profile but torch is common.txt's, shared with the CPU profile; the GPU profile only widens
torch to a range. pip's resolver (``--dry-run``, metadata only, nothing installed) must find one set of versions
for the whole file twice: with the torch build that ran on a lent H100 (2.11.0, PyPI's Linux wheel is the
CUDA 13.0 build) and with the CPU profile's wheel standing in (2.13.0+cpu). Needs the package registry, as
``make install`` does (CI has it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
RAN_ON_GPU = "2.11.0"  # torch 2.11.0+cu130, H100 (README "Installing")


def _lines(name: str) -> list[str]:
    text = (REQ / name).read_text()
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def _torch(name: str) -> Requirement:
    return next(Requirement(line) for line in _lines(name) if re.match(r"torch\b", line))


def test_gpu_profile_is_the_cpu_profile_with_a_torch_range() -> None:
    cpu, gpu = _lines("cpu.txt"), _lines("gpu.txt")
    assert [line for line in cpu if not line.startswith("torch")] == ["-r common.txt"]
    assert [line for line in gpu if not line.startswith("torch")] == ["-r common.txt"]
    spec = _torch("gpu.txt").specifier
    cpu_version = Version(str(next(iter(_torch("cpu.txt").specifier)).version).split("+")[0])
    # What ran on a GPU and what CI runs are both in range; nothing below what transformers 5.24 needs (2.6).
    assert spec.contains(RAN_ON_GPU) and spec.contains(cpu_version)
    assert not spec.contains("2.5.1") and not spec.contains("2.6")


def _resolve(tmp_path: Path, torch_pin: str) -> dict[str, str]:
    """pip's resolution of requirements/gpu.txt with torch constrained to ``torch_pin``: {name: version}."""
    constraint = tmp_path / "torch.txt"
    constraint.write_text(torch_pin + "\n")
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed"]
    cmd += ["--report", str(report), "-r", str(REQ / "gpu.txt"), "-c", str(constraint)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


@pytest.mark.parametrize("torch_pin", [f"torch=={RAN_ON_GPU}", "torch==2.13.0+cpu"])
def test_gpu_profile_resolves_together(tmp_path: Path, torch_pin: str) -> None:
    resolved = _resolve(tmp_path, torch_pin)
    assert resolved["torch"] == torch_pin.split("==")[1]
    assert resolved["transformers"] == "5.24.0"
    assert Version(resolved["tokenizers"]) >= Version("0.23.1")
    assert resolved["huggingface-hub"] == "1.33.0" and resolved["peft"] == "0.21.2"
    if "+cpu" not in torch_pin:  # the CUDA build brings its CUDA libraries
        assert any(name.startswith("nvidia-") for name in resolved)
