"""The launcher's signal handler: safe to re-enter (launchers and schedulers deliver a signal more than once)."""

from __future__ import annotations

import dis
import os
import signal

import pytest

from coati_kto.launch import torchrun
from coati_kto.runtime.signals import ABORT_EXIT_CODE, PENDING_STOP_ENV, STOP_EXIT_CODE


def test_signal_handler_imports_nothing() -> None:
    """A second SIGTERM during an import inside the handler left psutil half-initialised: the launcher exited 1
    with "partially initialized module 'psutil'" instead of 75 (seen 2 times in 3 under GNU timeout)."""
    assert not [
        i for i in dis.get_instructions(torchrun._forward) if i.opname in ("IMPORT_NAME", "IMPORT_FROM")
    ]


def test_handler_reentered_before_workers_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """No workers yet: SIGUSR1 is remembered for them, SIGTERM stops the launch; calling it twice is the same."""

    class NoChildren:  # pytest's own children (multiprocessing's resource tracker) must not be signalled
        def children(self, recursive: bool = False) -> list:
            return []

    monkeypatch.setattr(torchrun.psutil, "Process", NoChildren)
    # setenv first: it records the variable's absence, so the value the handler writes is undone after the test
    # (delenv of an absent variable records nothing: later runs in this process started "stopped").
    monkeypatch.setenv(PENDING_STOP_ENV, "")
    monkeypatch.delenv(PENDING_STOP_ENV)
    for _ in range(2):
        torchrun._forward(signal.SIGUSR1, None)
        assert os.environ[PENDING_STOP_ENV] == str(int(signal.SIGUSR1))
        with pytest.raises(torchrun._StoppedBeforeWorkersError):
            torchrun._forward(signal.SIGTERM, None)


def test_a_stop_signal_during_the_checks_before_launch_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`coati-kto train --nproc-per-node N` loads the config and runs the preflight (seconds of imports) before
    torchrun starts: SIGUSR1 there killed the launcher ("User defined signal 1", exit 138), SIGTERM gave -15."""

    class NoChildren:
        def children(self, recursive: bool = False) -> list:
            return []

    monkeypatch.setattr(torchrun.psutil, "Process", NoChildren)
    monkeypatch.setenv(PENDING_STOP_ENV, "")
    monkeypatch.delenv(PENDING_STOP_ENV)
    before = signal.getsignal(signal.SIGTERM)
    assert torchrun.before_workers(lambda: os.kill(os.getpid(), signal.SIGUSR1)) is None
    assert os.environ[PENDING_STOP_ENV] == str(int(signal.SIGUSR1))  # the workers inherit it
    assert torchrun.before_workers(lambda: os.kill(os.getpid(), signal.SIGTERM)) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "launcher: stopped by SIGTERM before the workers started\n"
    assert signal.getsignal(signal.SIGTERM) is before


_SECOND_CTRL_C_LATE = """
import os, signal, sys, threading
from coati_kto import cli
from coati_kto.parallel import distributed  # noqa: F401 - imported by the failure path: torch, before the timer
from coati_kto.runtime.signals import STOP

def collective_fails(args):
    raise RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:4810")

cli._run = collective_fails
os.environ["RANK"] = "0"
STOP.install()
STOP.received = signal.SIGINT  # the first Ctrl-C: a stop after the step
second = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))  # the second, late on this rank
second.daemon = True  # an exit before it fires must not wait for it
second.start()
sys.exit(cli.main(["train", "config.yaml"]))
"""


def test_a_second_ctrl_c_that_reaches_a_peer_first_still_aborts_this_rank() -> None:
    """Ctrl-C twice: the second SIGINT reached rank 1 first, which aborted (130); rank 0, in the step's
    collective, saw the peer gone and exited 1 with "another rank or node is gone" before its own second SIGINT
    arrived, so the launcher reported a failure, not an abort (seen in CI under load). A rank whose Ctrl-C stop
    is pending now waits briefly for its own second signal."""
    import subprocess
    import sys

    from coati_kto.runtime.signals import ABORT_EXIT_CODE

    done = subprocess.run(
        [sys.executable, "-c", _SECOND_CTRL_C_LATE], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == ABORT_EXIT_CODE, done.stderr[-2000:]
    assert done.stderr.strip() == "aborted by a second SIGINT: nothing saved since the last checkpoint"


def test_a_failed_upload_on_rank_0_is_its_own_exit_status_with_no_launcher_lines() -> None:
    """Rank 0 trained, saved and printed why output.push_to_hub's upload failed (exit 3); the launcher adds no
    "rank 0 failed" line and returns 3, not the 1 of a crashed worker."""
    from types import SimpleNamespace

    from coati_kto.errors import PUSH_FAILED_EXIT_CODE
    from coati_kto.launch.torchrun import _failure_lines

    def failed(*codes: int) -> SimpleNamespace:
        failures = {
            r: SimpleNamespace(exitcode=c, local_rank=r, signal_name=lambda: "") for r, c in enumerate(codes)
        }
        return SimpleNamespace(failures=failures)

    assert _failure_lines(failed(PUSH_FAILED_EXIT_CODE)) == ([], PUSH_FAILED_EXIT_CODE)
    lines, code = _failure_lines(failed(PUSH_FAILED_EXIT_CODE, 1))  # a worker that crashed is still a crash
    assert code == 1 and len(lines) == 2
    # Ctrl-C twice as the stop's checkpoint completes: a rank past it exits 75, one before it 130 (an abort; it
    # was "rank 1 failed with exit code 130", exit 1)
    assert _failure_lines(failed(ABORT_EXIT_CODE, STOP_EXIT_CODE)) == ([], ABORT_EXIT_CODE)
    assert _failure_lines(failed(STOP_EXIT_CODE, -signal.SIGTERM)) == ([], STOP_EXIT_CODE)
