"""Failure drills on real clusters built on this machine by tests/drills/tools/: netns_cluster.sh (SSH nodes in
network namespaces, for launch/colossalai_run.sh with a hostfile) and slurm_local.sh (a single-node SLURM, for
launch/slurm.sbatch). Each cluster is brought up once per session and always taken down. Skipped, with the
reason, where they cannot run (not root, no `ip netns`, no apt-get).

Each drill measures its time to stop (printed; run with -s to see it) and checks it against the 2-minute goal,
and checks numbers: weights equal to an uninterrupted 1 node x 2 processes run, bit for bit. That comparison target
runs on the worker pool's ranks (run_cli), not launched: the drills' launches are the multi-node ones.
The link-down and time-limit drills take 2-4 minutes each: they run only with COATI_KTO_SLOW_DRILLS=1.
What the drills wait on is set short where a documented knob allows it, the bound still checked: the launcher's grace
after a failed node (COATI_KTO_NODE_GRACE), SLURM's requeue delay (slurm_local.sh's SL_CRED_EXPIRE, its minimum)
and scheduler scans (SL_SCHED_INTERVAL). The SIGKILL and SIGTERM drills share one output directory's three
launches (fixture ``kill_then_sigterm``), each drill with its own assertions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import env, weights, write_run

from coati_kto.parallel.distributed import free_port
from coati_kto.testing.cli import run_cli

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(__file__).resolve().parent / "tools"  # netns_cluster.sh, slurm_local.sh: see tools/README.md
# 40 steps, the same in every run a drill compares (the LR schedule follows the count). An epoch is 36 steps here
# (drill_config's 72 desirable examples and 24 undesirable ones 3 times each, 2 ranks x 2), so every resumed run
# crosses an epoch boundary. An interrupted launch is stopped at its first checkpoint (step 4; 8 or 12 for the
# resumed one), its stop lands 1-2 steps later, 25 or more before the end. 96 steps cost 2.4x the compute for no more.
RUN = ["train.max_epochs=4", "train.max_steps=40"]
# The environment of every run: launches (helpers.env) and the reference's pooled ranks alike.
RUN_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
GOAL_S = 120.0
# COATI_KTO_NODE_GRACE in the sshd-less drill (default 30): its bound is checked, not waited out
NODE_GRACE_S = 5
SLURM_SETTINGS = {"SL_CRED_EXPIRE": "5", "SL_SCHED_INTERVAL": "1"}
slow = pytest.mark.skipif(
    os.environ.get("COATI_KTO_SLOW_DRILLS") != "1", reason="slow drill: COATI_KTO_SLOW_DRILLS=1"
)


def _bring_up(tool: Path, timeout: float, settings: dict[str, str] | None = None) -> None:
    """``tool up`` with ``settings`` (the tool's environment knobs); a machine where the cluster cannot be built
    (no netns, no package mirror) skips the drills with the tool's own last words, since the drills test the
    project, not the machine."""
    try:
        subprocess.run(
            [str(tool), "up"],
            check=True,
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(settings or {})},
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        said = " | ".join(
            ((err.stderr or "") if isinstance(err.stderr, str) else "").strip().splitlines()[-3:]
        )
        pytest.skip(f"{tool.name} up failed on this machine: {said or err}")


def _cluster_tool(name: str, needs: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip(f"{name} needs root")
    if shutil.which(needs) is None:
        pytest.skip(f"{name} needs {needs}")
    return TOOLS / name


@pytest.fixture(scope="session")
def netns_cluster() -> Iterator[dict[str, str]]:
    tool = _cluster_tool("netns_cluster.sh", "ip")
    try:
        _bring_up(tool, timeout=600)
        hostfile = subprocess.run([str(tool), "hostfile"], check=True, capture_output=True, text=True).stdout
        yield {
            "tool": str(tool),
            "HOSTFILE": hostfile.strip(),
            "MASTER_ADDR": "10.77.0.11",
            "NPROC_PER_NODE": "1",
            "GLOO_SOCKET_IFNAME": "cl0",
        }
    finally:
        subprocess.run([str(tool), "down"], capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[dict[str, str]]:
    tool = _cluster_tool("slurm_local.sh", "apt-get")
    try:
        # A requeued job may start again cred_expire + 1 s later, found by the next scan: 6-7 s instead of 11-16.
        _bring_up(tool, timeout=900, settings=SLURM_SETTINGS)
        exports = subprocess.run([str(tool), "env"], check=True, capture_output=True, text=True).stdout
        found = dict(
            line.removeprefix("export ").split("=", 1)
            for line in exports.splitlines()
            if line.startswith("export ")
        )
        yield {k: v.strip("'\"") for k, v in found.items()}
    finally:
        subprocess.run([str(tool), "down"], capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def drill_config(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return write_run(tmp_path_factory.mktemp("drills"), tiny_model_dir)


@pytest.fixture(scope="module")
def reference(drill_config: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """1 node x 2 processes, uninterrupted: what every drill's weights must equal, bit for bit. It proves nothing
    about a launcher (tests/e2e/test_launch.py does), so it runs the command on the worker pool's ranks (run_cli: the
    same code and kernels, 1 thread, without a launch's ~15 CPU-s of imports)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    done = run_cli(["train", str(drill_config), *RUN, f"output.dir={out}"], 2, env=RUN_ENV)
    assert done.returncodes == [0, 0], done.stderr[-3000:]
    return weights(out)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def colossalai_run(
    cluster: dict[str, str], config: Path, *overrides: str, settings: dict[str, str] | None = None
) -> subprocess.Popen:
    """launch/colossalai_run.sh on ``cluster``'s hostfile; ``settings``: more environment for the launch."""
    launch_env = {
        **env(),
        **{k: v for k, v in cluster.items() if k != "tool"},
        "MASTER_PORT": str(free_port()),
        **(settings or {}),
    }
    cmd = ["bash", str(REPO / "launch" / "colossalai_run.sh"), str(config), *RUN, *overrides]
    return subprocess.Popen(cmd, env=launch_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def latest_name(out: Path) -> str | None:
    latest = out / "checkpoints" / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def wait_for_checkpoint(
    out: Path, proc: subprocess.Popen | None = None, timeout: float = 300, newer_than: str | None = None
) -> None:
    """Until ``out`` has a latest checkpoint other than ``newer_than`` (a resumed run has saved one of its own)."""
    deadline = time.monotonic() + timeout
    while latest_name(out) in (None, newer_than):
        assert proc is None or proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)


def node_pids(node: str, needle: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    found = []
    for pid in listed:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(pid))
    return found


def report(drill: str, seconds: float, what: str = "stopped") -> None:
    print(f"\n[drill] {drill}: {what} {seconds:.1f} s after the fault", flush=True)


def test_two_nodes_through_colossalai_run_match_one_node(
    netns_cluster, drill_config, reference, tmp_path
) -> None:
    out = tmp_path / "out"
    proc = colossalai_run(netns_cluster, drill_config, f"output.dir={out}")
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert_same(reference, weights(out))


def test_tensor_parallel_inside_each_node_data_parallel_across_nodes(
    netns_cluster, drill_config, tmp_path
) -> None:
    """tp 2 inside each of 2 nodes (ranks 0-1 on node1, 2-3 on node2: ColossalAI's mesh keeps tp innermost, so no
    tensor-parallel collective crosses a node) and dp 2 across them: the weights of 1 node x 4 processes with the
    same layout, bit for bit (same ranks, same groups, same collectives). The 1-node run is the comparison target,
    not a launch under test: it runs on the worker pool's ranks (run_cli), as the reference does."""
    # 8 steps: every step runs each tp and dp collective; a 4-process step costs about twice a 2-process one
    layout = ["plugin.tp_size=2", "train.max_steps=8"]
    one_node = tmp_path / "one_node"
    done = run_cli(["train", str(drill_config), *RUN, *layout, f"output.dir={one_node}"], 4, env=RUN_ENV)
    assert done.returncodes == [0] * 4, done.stderr[-3000:]
    two_nodes = tmp_path / "two_nodes"
    proc = colossalai_run(
        {**netns_cluster, "NPROC_PER_NODE": "2"}, drill_config, *layout, f"output.dir={two_nodes}"
    )
    output, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, output[-3000:]
    assert_same(weights(one_node), weights(two_nodes))


@dataclass
class Launch:
    """One launch of the shared output directory: what it printed, its exit status, the latest checkpoint when it
    ended and whether that one was complete then (the next launch prunes it: output.keep_last), and the seconds
    from the fault to its end."""

    output: str
    returncode: int
    latest: Path
    complete: bool
    stopped_s: float = 0.0


def ended(proc: subprocess.Popen, out: Path, timeout: float, fault: float | None = None) -> Launch:
    """``proc``'s Launch once it ended; ``fault``: when the fault was made (time.monotonic)."""
    output, _ = proc.communicate(timeout=timeout)
    stopped = 0.0 if fault is None else time.monotonic() - fault
    latest = out / "checkpoints" / str(latest_name(out))
    return Launch(output, proc.returncode, latest, (latest / "COMPLETE").is_file(), stopped)


@pytest.fixture(scope="module")
def kill_then_sigterm(
    netns_cluster, drill_config, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Launch, Launch, Launch, dict[str, torch.Tensor]]:
    """Three launches on one output directory, so the SIGKILL and SIGTERM drills share their runs (a launch
    costs ~20 s here): A trains from scratch until node2's rank is SIGKILLed; B resumes from A's checkpoint
    until node1's launcher gets SIGTERM (after B saved a checkpoint of its own); C resumes from B's and runs
    to the end. C's weights equal the uninterrupted run's only if both resumes continued exactly."""
    out = tmp_path_factory.mktemp("kill_then_sigterm") / "out"

    proc = colossalai_run(netns_cluster, drill_config, f"output.dir={out}")
    wait_for_checkpoint(out, proc)
    (worker,) = node_pids("node2", "-u -m coati_kto train")
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    a = ended(proc, out, GOAL_S + 60, killed)

    proc = colossalai_run(netns_cluster, drill_config, f"output.dir={out}", "train.resume=auto")
    wait_for_checkpoint(out, proc, newer_than=a.latest.name)
    # With a hostfile every node's ranks run under its sshd: signal one node's launcher (docs/operations.md: `ssh node1
    # pkill -TERM -f coati_kto.launch`); the ranks' vote stops every node after the same step.
    (launcher,) = node_pids("node1", "-m coati_kto.launch")
    termed = time.monotonic()
    os.kill(launcher, signal.SIGTERM)
    b = ended(proc, out, GOAL_S + 60, termed)

    proc = colossalai_run(netns_cluster, drill_config, f"output.dir={out}", "train.resume=auto")
    c = ended(proc, out, 600)
    return a, b, c, (weights(out) if c.returncode == 0 else {})


def test_killing_the_rank_on_node2_ends_the_job_and_resume_completes(kill_then_sigterm, reference) -> None:
    killed, resumed, finished, final = kill_then_sigterm
    report("SIGKILL to the rank on node2", killed.stopped_s)
    assert killed.returncode != 0 and killed.stopped_s < GOAL_S, killed.output[-3000:]
    assert "launcher: rank 1 (local rank 0) on node2 failed with signal SIGKILL" in killed.output
    assert (
        "[rank 0] error: a collective failed because another rank or node is gone (Connection"
        in killed.output
    )
    assert "Traceback" not in killed.output
    assert killed.complete
    # the resume from the killed run's checkpoint trained on (B saved newer checkpoints before its SIGTERM), and
    # the run it continued ends with the uninterrupted weights (C)
    assert f"resumed from {killed.latest}" in resumed.output, resumed.output[-3000:]
    assert finished.returncode == 0, finished.output[-3000:]
    assert_same(reference, final)


def test_a_sigterm_stops_both_nodes_cleanly_with_exit_75_and_resume_completes(
    kill_then_sigterm, reference
) -> None:
    _, termed, finished, final = kill_then_sigterm
    report("SIGTERM to node1's launcher", termed.stopped_s)
    assert termed.returncode == 75, termed.output[-3000:]
    stopped = [
        line for line in termed.output.splitlines() if line.startswith("stopped by SIGTERM after step ")
    ]
    assert len(stopped) == 1, termed.output[-3000:]
    # both nodes' ranks stopped after the same voted step and exited 75: neither reported a failure
    assert "launcher: stopped cleanly on " in termed.output and ": failure" not in termed.output, (
        termed.output[-3000:]
    )
    assert termed.complete and stopped[0].endswith(
        f"checkpoint {termed.latest}; resume with train.resume=auto"
    )
    assert finished.returncode == 0, finished.output[-3000:]
    assert f"resumed from {termed.latest}" in finished.output
    assert_same(reference, final)


def test_a_node_without_sshd_fails_the_launch_in_bounded_time(netns_cluster, drill_config, tmp_path) -> None:
    """The launcher gives the other nodes COATI_KTO_NODE_GRACE seconds once one failed; set to NODE_GRACE_S here,
    so the drill checks that bound without waiting out the 30 s default. node1's launcher waits on its rendezvous
    meanwhile (90 s), so it is still there when the grace ends."""
    sshd = Path("/tmp/netns_cluster/nodes/node2/sshd.pid")
    os.kill(int(sshd.read_text()), signal.SIGTERM)
    try:
        started = time.monotonic()
        proc = colossalai_run(
            netns_cluster,
            drill_config,
            f"output.dir={tmp_path}",
            settings={"COATI_KTO_NODE_GRACE": str(NODE_GRACE_S)},
        )
        output, _ = proc.communicate(timeout=GOAL_S + 60)
        stopped = time.monotonic() - started
    finally:
        for pid in node_pids(
            "node1", "coati_kto"
        ):  # the abandoned launcher: its rendezvous would end it in 90 s
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        subprocess.run([netns_cluster["tool"], "up"], check=True, capture_output=True, timeout=300)
    report("node2 without sshd at launch", stopped)
    assert proc.returncode != 0 and NODE_GRACE_S < stopped < GOAL_S, output[-3000:]
    assert "Unable to connect to port 22 on 10.77.0.12" in output
    assert (
        f"launcher: node 10.77.0.11 had not finished {NODE_GRACE_S} s after another node failed: stopped waiting"
        in output
    )


@slow
def test_a_node_whose_link_goes_down_mid_run_ends_the_job(netns_cluster, drill_config, tmp_path) -> None:
    out = tmp_path / "out"
    proc = colossalai_run(
        netns_cluster, drill_config, f"output.dir={out}", "train.max_epochs=40", "train.max_steps=960"
    )
    wait_for_checkpoint(out, proc)
    down = time.monotonic()
    subprocess.run(["ip", "netns", "exec", "node2", "ip", "link", "set", "cl0", "down"], check=True)
    try:
        output, _ = proc.communicate(timeout=GOAL_S + 120)
        stopped = time.monotonic() - down
    finally:
        subprocess.run(["ip", "netns", "exec", "node2", "ip", "link", "set", "cl0", "up"], check=True)
    report("node2's link down mid-run", stopped)
    assert proc.returncode != 0 and stopped < GOAL_S
    assert "[rank 0 on node1] error: rank 1 on node2 stopped responding" in output
    assert "launcher: node 10.77.0.12 had not finished 30 s after another node failed" in output
    assert (out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() / "COMPLETE").is_file()


def sbatch(
    cluster: dict[str, str], config: Path, log: Path, *options: str, overrides: tuple[str, ...] = ()
) -> str:
    cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={log}", *options]
    cmd += [str(REPO / "launch" / "slurm.sbatch"), str(config), *RUN, *overrides]
    submit_env = {**env(), **cluster, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    done = subprocess.run(cmd, env=submit_env, capture_output=True, text=True, cwd=REPO, check=True)
    return done.stdout.strip().split(";")[0]


def job_field(cluster: dict[str, str], job: str, field: str) -> str:
    shown = subprocess.run(
        ["scontrol", "show", "job", job], env={**os.environ, **cluster}, capture_output=True, text=True
    )
    return next(w.split("=", 1)[1] for w in shown.stdout.split() if w.startswith(f"{field}="))


def wait_for_job(cluster: dict[str, str], job: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while (state := job_field(cluster, job, "JobState")) not in {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
    }:
        assert time.monotonic() < deadline, f"job {job} still {state}"
        time.sleep(0.2)
    return state


def test_slurm_requeue_resumes_and_finishes_like_an_uninterrupted_run(
    slurm_cluster, drill_config, reference, tmp_path
) -> None:
    out, log = tmp_path / "out", tmp_path / "slurm.out"
    job = sbatch(slurm_cluster, drill_config, log, "--time=10:00", overrides=(f"output.dir={out}",))
    wait_for_checkpoint(out)
    requeued = time.monotonic()
    subprocess.run(["scontrol", "requeue", job], env={**os.environ, **slurm_cluster}, check=True)
    assert wait_for_job(slurm_cluster, job) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    report(f"scontrol requeue of job {job}", time.monotonic() - requeued, "resumed and finished")
    assert job_field(slurm_cluster, job, "Restarts") == "1"
    assert "1 node(s) x 2 process(es) (SLURM_GPUS_ON_NODE=unset, OMP_NUM_THREADS=1)" in text
    assert "stopped by SIGTERM after step" in text and "(restart 1)" in text and "resumed from" in text
    assert_same(reference, weights(out))


@slow
def test_slurm_time_limit_warning_checkpoints_requeues_and_finishes(
    slurm_cluster, drill_config, tmp_path
) -> None:
    out, log = tmp_path / "out", tmp_path / "slurm.out"
    long_run = ("train.max_epochs=60", "train.max_steps=1440", "output.save_interval=0")
    job = sbatch(
        slurm_cluster,
        drill_config,
        log,
        "--time=2:00",
        "--signal=B:USR1@60",
        overrides=(f"output.dir={out}", *long_run),
    )
    local = [
        sys.executable,
        "-m",
        "coati_kto",
        "train",
        "--nproc-per-node",
        "2",
        str(drill_config),
        *RUN,
        *long_run,
    ]
    done = subprocess.run(
        [*local, f"output.dir={tmp_path / 'reference'}"], env=env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert wait_for_job(slurm_cluster, job, timeout=900) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGUSR1 after step" in text and "requeueing job" in text and "resumed from" in text
    assert_same(weights(tmp_path / "reference"), weights(out))
