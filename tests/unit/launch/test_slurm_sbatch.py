"""launch/slurm.sbatch's step command, run by bash with stand-ins for srun, scontrol and the repo's Python.

The real script under a real SLURM is the drills' (tests/drills); here the command srun is given is checked
for what reaches the launcher when the repository path and the arguments hold quotes and spaces."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[3] / "launch" / "slurm.sbatch"

# srun: drop its options, run the step's command (bash -c "...") as SLURM would on each node.
SRUN = """#!/usr/bin/env bash
while [[ $1 == --* ]]; do shift; done
export SLURM_NODEID=0
exec "$@"
"""
SCONTROL = """#!/usr/bin/env bash
[[ $1 == show ]] && echo node-a
exit 0
"""
# The repo's .venv/bin/python: records where it runs and what it is given.
PYTHON = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STEP_RECORD"], "w") as f:
    json.dump({"cwd": os.getcwd(), "argv": sys.argv[1:]}, f)
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("restarts", [0, 1])
def test_the_step_starts_in_a_repo_whose_path_has_quotes_with_every_argument_intact(
    tmp_path: Path, restarts: int
) -> None:
    """A repository under a path with a single quote and a space (`/home/o'brien/my runs`) broke the step's
    `cd '$repo'`, so every job there failed at once; arguments with quotes, `$` and spaces reach the launcher as
    given, and a requeued job (SLURM_RESTART_COUNT > 0) adds train.resume=auto."""
    bin_dir, repo = tmp_path / "bin", tmp_path / "o'brien's \"runs\" $HOME"
    _executable(bin_dir / "srun", SRUN)
    _executable(bin_dir / "scontrol", SCONTROL)
    _executable(bin_dir / "scancel", "#!/usr/bin/env bash\nexit 0\n")
    _executable(repo / ".venv" / "bin" / "python", PYTHON)
    record = tmp_path / "step.json"
    args = ["configs/my run.yaml", 'logging.wandb_project=it\'s [a] "test" $HOME']
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "SLURM_RESTART_COUNT": str(restarts),
        "STEP_RECORD": str(record),
    }
    environ.pop("SLURM_GPUS_ON_NODE", None)
    environ.pop("NPROC_PER_NODE", None)
    done = subprocess.run(
        ["bash", str(SBATCH), *args], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    step = json.loads(record.read_text())
    assert step["cwd"] == str(repo)
    launcher, train = step["argv"][: step["argv"].index("-m", 2)], step["argv"][step["argv"].index("-m", 2) :]
    assert launcher[:2] == ["-m", "coati_kto.launch"]
    assert launcher[launcher.index("--nproc_per_node") + 1] == "2"
    assert launcher[launcher.index("--master_addr") + 1] == "node-a"
    assert train == ["-m", "coati_kto", "train", *args, *(["train.resume=auto"] if restarts else [])]


def _stand_ins(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "srun", SRUN)
    _executable(bin_dir / "scontrol", SCONTROL)
    _executable(bin_dir / "scancel", "#!/usr/bin/env bash\nexit 0\n")
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node-a",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_CPUS_ON_NODE": "2",
        "STEP_RECORD": str(tmp_path / "step.json"),
    }
    for name in ("SLURM_GPUS_ON_NODE", "NPROC_PER_NODE", "COATI_KTO_REPO", "SLURM_RESTART_COUNT"):
        environ.pop(name, None)
    return environ


def test_a_job_submitted_from_elsewhere_runs_the_repo_coati_kto_repo_names(tmp_path: Path) -> None:
    """The step ran $SLURM_SUBMIT_DIR/.venv/bin/python: a job submitted from another directory failed on every
    node with exit 127 once the allocation was granted. COATI_KTO_REPO names the repository; without it and
    without a .venv where sbatch ran, one line and exit 2 before any step starts."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "runs"
    _executable(repo / ".venv" / "bin" / "python", PYTHON)
    elsewhere.mkdir()
    environ = {**_stand_ins(tmp_path), "SLURM_SUBMIT_DIR": str(elsewhere)}
    run = ["bash", str(SBATCH), "configs/x.yaml"]
    missing = subprocess.run(run, env=environ, cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines()[-1] == (
        f"coati-kto: no {elsewhere}/.venv/bin/python: run sbatch from the repository, or set COATI_KTO_REPO to it"
    )
    environ["COATI_KTO_REPO"] = str(repo)
    done = subprocess.run(run, env=environ, cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "step.json").read_text())["cwd"] == str(repo)
