"""launch/slurm.sbatch on two nodes, with a stand-in srun that behaves as SLURM documents: it returns the highest
exit status of its tasks, or 128 + the signal that killed one, and with --kill-on-bad-exit (or KillOnBadExit in
slurm.conf) SIGKILLs every task once one exits non-zero. A clean stop exits 75 on every node, not at the same
instant: srun took the first 75 for a bad exit, killed the node still finishing its checkpoint, returned 137,
and the job that stopped at its time-limit warning never requeued.

The real script under a real SLURM is the drills' (tests/drills)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

SBATCH = Path(__file__).resolve().parents[3] / "launch" / "slurm.sbatch"

# srun: one task per node (SLURM_NODEID), each in its own process group; SIGUSR2 (from scancel --signal=KILL
# JOB.STEP) kills the step's tasks. Default kill-on-bad-exit on, as a cluster's KillOnBadExit=1 makes it.
SRUN = """#!/usr/bin/env python3
import os, signal, subprocess, sys, time
args = sys.argv[1:]
kill_on_bad_exit = True
while args[0].startswith("--"):
    option = args.pop(0)
    if option.startswith("--kill-on-bad-exit"):
        kill_on_bad_exit = not option.endswith("=0")
fake = os.environ["FAKE"]
open(os.path.join(fake, "srun.pid"), "w").write(str(os.getpid()))
tasks = [
    subprocess.Popen(args, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_STEP_ID": "0"}, start_new_session=True)
    for n in range(2)
]
def kill_step(*_):
    for task in tasks:
        if task.poll() is None:
            os.killpg(task.pid, signal.SIGKILL)
signal.signal(signal.SIGUSR2, kill_step)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
while [task.poll() for task in tasks].count(None):
    if kill_on_bad_exit and any(task.returncode not in (None, 0) for task in tasks):
        kill_step()
    time.sleep(0.02)
codes = [task.returncode for task in tasks]
signals = [-c for c in codes if c < 0]
sys.exit(128 + max(signals) if signals else max(codes))
"""
SCANCEL = """#!/usr/bin/env bash
echo "scancel $*" >> "$FAKE/calls"
if [[ $* == *--signal=KILL* ]]; then kill -USR2 "$(cat "$FAKE/srun.pid")"; fi
exit 0
"""
SCONTROL = """#!/usr/bin/env bash
[[ $1 == show ]] && { printf "node-a\nnode-b\n"; exit 0; }
echo "scontrol $*" >> "$FAKE/calls"
"""
# A node's launcher: says it runs, waits for the test's "go", then exits CODE_<node> after DELAY_<node> seconds.
PYTHON = """#!/usr/bin/env bash
touch "$FAKE/started-$SLURM_NODEID"
while [[ ! -e $FAKE/go ]]; do sleep 0.02; done
code=CODE_$SLURM_NODEID delay=DELAY_$SLURM_NODEID
sleep "${!delay}"
exit "${!code}"
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _job(tmp_path: Path, codes: tuple[int, int], delays: tuple[float, float]) -> tuple[int, str, str]:
    """Run the batch script on two stand-in nodes, send it the time-limit warning (SIGUSR1) once both launchers
    run, and return its exit status, the scancel/scontrol calls and its stderr."""
    bin_dir, repo, fake = tmp_path / "bin", tmp_path / "repo", tmp_path / "fake"
    fake.mkdir()
    _executable(bin_dir / "srun", SRUN)
    _executable(bin_dir / "scancel", SCANCEL)
    _executable(bin_dir / "scontrol", SCONTROL)
    _executable(repo / ".venv" / "bin" / "python", PYTHON)
    environ = {k: v for k, v in os.environ.items() if k not in ("SLURM_GPUS_ON_NODE", "NPROC_PER_NODE")}
    environ |= {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE": str(fake),
        "SLURM_SUBMIT_DIR": str(repo),
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_CPUS_ON_NODE": "1",
        "CODE_0": str(codes[0]),
        "CODE_1": str(codes[1]),
        "DELAY_0": str(delays[0]),
        "DELAY_1": str(delays[1]),
    }
    job = subprocess.Popen(
        ["bash", str(SBATCH), "cfg.yaml"], env=environ, cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not all((fake / f"started-{n}").exists() for n in range(2)):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.02)
    job.send_signal(signal.SIGUSR1)  # SLURM's --signal=B:USR1@300
    while "--signal=USR1" not in ((fake / "calls").read_text() if (fake / "calls").exists() else ""):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.02)
    (fake / "go").touch()
    _, err = job.communicate(timeout=30)
    return job.returncode, (fake / "calls").read_text(), err


def test_a_clean_stop_on_every_node_requeues_the_job(tmp_path: Path) -> None:
    """Node 0 exits 75 first; node 1 is still finishing its checkpoint and must not be killed for it."""
    code, calls, err = _job(tmp_path, (75, 75), (0, 1.0))
    assert code == 75, (calls, err)
    assert "scontrol requeue 7" in calls and "--signal=KILL" not in calls, (calls, err)


@pytest.mark.parametrize("failed", [1, 134])
def test_a_node_that_fails_ends_the_step_and_the_job_is_not_requeued(tmp_path: Path, failed: int) -> None:
    """What --kill-on-bad-exit did for a real failure still happens: the other node's launcher (it would run for
    30 s more) is killed at once, and the job ends without a requeue."""
    started = time.monotonic()
    code, calls, err = _job(tmp_path, (75, failed), (30, 0))
    assert time.monotonic() - started < 20, (calls, err)
    assert code not in (0, 75), (code, calls, err)
    assert "scancel --signal=KILL 7.0" in calls and "requeue" not in calls, (calls, err)
    assert f"node 1 exited {failed}" in err


@pytest.mark.parametrize(
    ("warned", "status", "requeue"),
    [(1, 75, True), (0, 75, False), (1, 0, False), (1, 1, False), (1, 137, False), (1, 143, False)],
)
def test_requeue_decision(warned: int, status: int, requeue: bool) -> None:
    """Only a stop at the time-limit warning (SIGUSR1 to the script) that ended in 75 requeues."""
    function = subprocess.run(
        ["sed", "-n", "/^should_requeue()/,/^}/p", str(SBATCH)], capture_output=True, text=True, check=True
    ).stdout
    assert function, "no should_requeue function in launch/slurm.sbatch"
    done = subprocess.run(["bash", "-c", f"{function}\nshould_requeue {warned} {status}"], timeout=10)
    assert (done.returncode == 0) is requeue
