"""``coati_kto.testing.cli.run_cli``: a command run on the ranks gives what its process would (exit status, the
text written to fds 1 and 2 by print, logging, warnings, C), sees the environment, cwd and argv of that process,
creates and destroys its own process group, and leaves the ranks' group usable; the real CLI's output equals a
subprocess's."""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import MINIMAL, env, write_config

from coati_kto.testing.cli import run_cli
from coati_kto.testing.distributed import FRESH_ENV, pool_stats, run_distributed

SHOWN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "PROBE_VALUE")


def _probe(argv: list[str]) -> int:
    """A stand-in command: says what it sees, writes to fds 1 and 2 every way, then does what ``argv[0]`` says."""
    from coati_kto.parallel.distributed import init_distributed

    print("argv", os.path.basename(sys.argv[0]), sys.argv[1:] == argv)
    print("env", [os.environ.get(k) for k in SHOWN])
    print("cwd", os.getcwd())
    print("initialized", dist.is_initialized())
    logging.getLogger("probe").warning("a logged warning")
    warnings.warn("a python warning", stacklevel=1)
    os.write(2, b"raw fd 2\n")
    ctypes.CDLL(None).printf(b"C stdout\n")  # libc's buffer: flushed by run_cli
    action = argv[0]
    if action == "group":  # as the CLI does: its own group (from the launcher variables), then destroyed
        init_distributed(timeout_s=60)
        total = torch.tensor([dist.get_rank() + 1])
        dist.all_reduce(total)
        print("group", dist.get_world_size(), os.environ["MASTER_PORT"], int(total))
        dist.destroy_process_group()
    elif action == "leave":  # an uncaught exception with a group up: the process would just exit
        init_distributed(timeout_s=60)
        raise ValueError("boom")
    elif action == "exit":
        sys.exit(int(argv[1]))
    elif action == "exit-message":
        sys.exit("a message")
    elif action == "interleave":
        for i in range(3):
            print(f"out {i}", flush=True)
            print(f"err {i}", file=sys.stderr, flush=True)
    return int(argv[1]) if len(argv) > 1 else 0


def _world_sum(_: int) -> tuple[int, int]:
    """An all-reduce on the ranks' own group (the one run_cli sets aside and puts back)."""
    total = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(total)
    return dist.get_world_size(), int(total)


def _pooled() -> bool:
    return os.environ.get(FRESH_ENV, "") in ("", "0")


def test_a_command_sees_its_process_and_its_output_is_captured(tmp_path: Path) -> None:
    before = pool_stats()
    done = run_cli(["plain", "5"], env={"PROBE_VALUE": "set", "RANK": "7"}, cwd=tmp_path, command=_probe)
    assert done.returncode == 5 and done.returncodes == [5]
    # `python -m coati_kto`: no launcher variables (an env override applies on top), no group yet.
    assert done.stdout.splitlines() == [
        "argv __main__.py True",
        f"env {['7', None, None, None, None, 'set']}",
        f"cwd {tmp_path}",
        "initialized False",
        "C stdout",
    ]
    err = done.stderr.splitlines()
    assert err[0] == "a logged warning"
    assert err[1].endswith("UserWarning: a python warning") and err[-1] == "raw fd 2", err
    assert "PROBE_VALUE" not in os.environ and os.getcwd() != str(tmp_path)  # the call's only

    assert run_cli(["exit", "3"], command=_probe).returncode == 3
    message = run_cli(["exit-message"], command=_probe)
    assert (message.returncode, message.stderr.splitlines()[-1]) == (1, "a message")
    merged = run_cli(["interleave"], merge_stderr=True, command=_probe)
    tail = merged.stdout.splitlines()[-6:]
    assert (tail, merged.stderr) == (["out 0", "err 0", "out 1", "err 1", "out 2", "err 2"], "")

    # An uncaught exception while the command's group is up: its traceback, exit 1; that rank retires.
    left = run_cli(["leave"], command=_probe)
    assert left.returncode == 1
    assert "Traceback (most recent call last):" in left.stderr and left.stderr.endswith("ValueError: boom\n")
    assert run_distributed(_world_sum, 1, 0) == [(1, 1)]
    if _pooled():
        after = pool_stats()
        assert after.get("pool retired", 0) == before.get("pool retired", 0) + 1
        assert (
            after.get("pool start", 0) <= before.get("pool start", 0) + 2
        )  # at most: the first, the retired


def test_two_ranks_get_launcher_variables_and_their_own_group(tmp_path: Path) -> None:
    assert run_distributed(_world_sum, 2, 0) == [(2, 3), (2, 3)]
    starts = pool_stats().get("pool start", 0)
    done = run_cli(["group"], 2, command=_probe)
    assert done.returncodes == [0, 0]
    lines = [rank.stdout.splitlines() for rank in done.ranks]
    assert [out[1] for out in lines] == [
        f"env {['0', '2', '0', '2', '127.0.0.1', None]}",
        f"env {['1', '2', '1', '2', '127.0.0.1', None]}",
    ]
    assert [out[3] for out in lines] == ["initialized False", "initialized False"]
    groups = [[line for line in out if line.startswith("group ")] for out in lines]
    port = groups[0][0].split()[2]
    assert groups == [[f"group 2 {port} 3"], [f"group 2 {port} 3"]]
    # The ranks' own group was put back: the next call runs on it, no new ranks.
    assert run_distributed(_world_sum, 2, 0) == [(2, 3), (2, 3)]
    if _pooled():
        assert pool_stats().get("pool start", 0) == starts


def test_the_real_cli_gives_what_a_subprocess_gives(tmp_path: Path) -> None:
    config = write_config(tmp_path, MINIMAL)
    for argv in (["--version"], ["config", str(config), "train.lr=2e-6"], ["config"], ["no-such-command"]):
        proc = subprocess.run(
            [sys.executable, "-m", "coati_kto", *argv], env=env(), capture_output=True, text=True, timeout=300
        )
        done = run_cli(argv)
        assert (done.returncode, done.stdout, done.stderr) == (proc.returncode, proc.stdout, proc.stderr), (
            argv
        )
        assert proc.returncode in (0, 2) and proc.stdout + proc.stderr
