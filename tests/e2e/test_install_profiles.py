"""The install profiles resolve: requirements/gpu.txt's pins go together, checked on the CPU.

Every pin of the GPU profile but torch is common.txt's, shared with the CPU profile; the GPU profile only widens
torch to a range. Two sets of versions must satisfy the whole file:
- with the torch build that ran on a lent H100 (2.11.0, PyPI's Linux wheel is the CUDA 13.0 build): pip's
  resolver finds one (``--dry-run``, metadata only, nothing installed). Needs the package registry, as
  ``make install`` does (CI has it);
- with the CPU profile's wheel standing in (2.13.0+cpu): the environment the tests run in is one. ``make
  install`` resolved it from requirements/cpu.txt (the same file with that torch pinned), so each line of
  gpu.txt is checked against the installed versions and ``pip check`` against every installed package's own
  requirements, instead of a second resolution against the registry (17 CPU-s of pip, 2026-11-30).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

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


def test_gpu_profile_resolves_together_with_the_cuda_torch_that_ran_on_a_gpu(tmp_path: Path) -> None:
    resolved = _resolve(tmp_path, f"torch=={RAN_ON_GPU}")
    assert resolved["torch"] == RAN_ON_GPU
    _assert_common_pins(resolved)
    assert any(name.startswith("nvidia-") for name in resolved)  # the CUDA build brings its CUDA libraries


def test_the_installed_environment_is_a_resolution_of_the_gpu_profile() -> None:
    """The CPU wheel standing in: the installed versions meet every line of gpu.txt (and common.txt), and every
    installed package's own requirements but ColossalAI's (installed with --no-deps on purpose: its metadata pins
    torch<=2.5.1; docs/installing.md)."""
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    lines = [line for name in ("gpu.txt", "common.txt") for line in _lines(name) if not line.startswith("-r")]
    for requirement in map(Requirement, lines):
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        version = installed.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement} is not installed"
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{requirement}: installed {version}"
        )
    _assert_common_pins(installed)
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    problems = [line for line in check.stdout.splitlines() if not line.startswith("colossalai ")]
    assert not problems, check.stdout + check.stderr


def _assert_common_pins(resolved: dict[str, str]) -> None:
    assert resolved["transformers"] == "5.24.0"
    assert Version(resolved["tokenizers"]) >= Version("0.23.1")
    assert resolved["huggingface-hub"] == "1.33.0" and resolved["peft"] == "0.21.2"
