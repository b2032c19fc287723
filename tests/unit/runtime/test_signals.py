"""Ctrl-C twice aborts even when both arrive while the main thread is inside C (coati_kto.runtime.signals); a
stop signal before a rank's handlers, or as it leaves, does not kill it.

Python runs a handler once for all the deliveries that came while the main thread was in C code: a rank blocked
in a gloo collective saw Ctrl-C twice as one, stopped cleanly while its peer aborted, and the launch exited 1
instead of 130 (seen in test_operations' signals test at load 12). The stop handlers now count deliveries
through the interpreter's wakeup fd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP, STOP_EXIT_CODE, STOP_SIGNALS

PROBE = """
import hashlib, os, signal, threading, time
from coati_kto.runtime.signals import STOP

STOP.install()
SENDS, SAVED = %d, %r
if SAVED:
    STOP.stopped_with(SAVED)

def ctrl_c():
    time.sleep(0.1)
    for i in range(SENDS):
        if i:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    print("sent", flush=True)

sender = threading.Thread(target=ctrl_c)
sender.start()
# About a second in C with the GIL released: the sender runs, and no Python handler can run until it returns.
hashlib.pbkdf2_hmac("sha256", b"coati", b"kto", 5_000_000)
sender.join()
time.sleep(0.2)
print("still running, received", STOP.received, flush=True)
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "RANK"}


def _run(sends: int, saved: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PROBE % (sends, saved)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_two_ctrl_c_that_arrive_during_c_code_abort() -> None:
    done = _run(2)
    assert done.stdout.splitlines() == ["sent"], done.stdout + done.stderr
    assert done.returncode == ABORT_EXIT_CODE, done.stdout + done.stderr
    assert done.stderr.count("aborted by a second SIGINT: nothing saved since the last checkpoint") == 1


def test_one_ctrl_c_during_c_code_asks_for_a_clean_stop() -> None:
    done = _run(1)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == ["sent", "still running, received 2"]
    assert "stopping after the current optimizer step" in done.stderr


def test_a_second_ctrl_c_after_the_stops_checkpoint_exits_75() -> None:
    """The stop's checkpoint written (a run waiting on its uploads, or exiting): Ctrl-C again said "nothing saved
    since the last checkpoint" and exited 130, where the checkpoint it had just named was complete."""
    done = _run(2, "out/checkpoints/step-2")
    assert done.returncode == STOP_EXIT_CODE, done.stdout + done.stderr
    assert done.stderr.splitlines()[-1] == (
        "a second SIGINT: exiting now; the stop's checkpoint out/checkpoints/step-2 is complete; resume with "
        "train.resume=auto"
    )


_RANK = """
import os, signal, sys
from coati_kto import cli
from coati_kto.runtime.signals import STOP, TrainingStoppedError

def train(args):
    if STOP.received is None:
        return 0
    raise TrainingStoppedError(signal.Signals(STOP.received).name, 1, "out/checkpoints/step-1")

cli._run = train
os.environ["RANK"] = "0"
sys.exit(cli.main(["train", "config.yaml"]))
"""


def test_a_stop_that_reaches_a_rank_before_its_handlers_is_a_clean_stop() -> None:
    """coati_kto.launch starts its ranks with the stop signals blocked (the mask is inherited); a SIGTERM sent
    before a rank installed its handlers killed it ("rank 1 failed with signal SIGTERM", launch exit 1). It is
    pending now, and counts once the rank's handlers are in: a clean stop."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:  # as the launcher starts a rank
        rank = subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    rank.send_signal(signal.SIGTERM)  # before its interpreter has even started
    out, err = rank.communicate(timeout=120)
    assert rank.returncode == STOP_EXIT_CODE, out + err
    assert "SIGTERM received: stopping after the current optimizer step" in err
    assert err.splitlines()[-1].startswith("stopped by SIGTERM after step 1;")


_LEAVING = """
import gc, os, signal, sys
from coati_kto import cli
from coati_kto.runtime.signals import TrainingStoppedError

class LateSignals:
    # Collected as the interpreter tears its modules down: after it put the Python handlers back to default.
    def __del__(self, os=os, signal=signal):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        os.write(1, b"still here\\n")

late = LateSignals()

def stopped(args):
    raise TrainingStoppedError("SIGTERM", 3, "out/checkpoints/step-3")

cli._run = stopped
os.environ["RANK"] = "1"
sys.argv = ["coati-kto", "train", "config.yaml"]
gc.disable()  # entry then freezes nothing, and the teardown reaches `late`
sys.exit(cli.entry())
"""


def test_stop_signals_as_a_rank_leaves_do_not_change_its_exit_status() -> None:
    """A SIGTERM repeated (or a second Ctrl-C) as the ranks exited 75 killed a rank in its interpreter's
    teardown, where the handlers are back to the default action: -15 or -2, and the launch exited 1 with
    "rank 0 failed with signal SIGTERM" (3 times in 3, 0.05-0.2 s after the stop line). Once ``main``
    returned, the stop signals are ignored."""
    done = subprocess.run(
        [sys.executable, "-c", _LEAVING], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == STOP_EXIT_CODE, done.stdout + done.stderr
    assert done.stdout == "still here\n"


def test_the_command_lines_that_launch_block_the_stop_signals_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """``coati-kto train --nproc-per-node N`` takes the stop signals from its first step (a SIGTERM in the first
    second was the default action's silent 143); the other command lines, and the ranks, leave them alone."""
    monkeypatch.delenv("RANK", raising=False)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # a one-process command installs its own
    launching = [
        ["train", "c.yaml", "--nproc-per-node", "2"],
        ["train", "--nproc-per-node=2", "c.yaml", "train.lr=1e-6"],
        ["export", "c.yaml", "--nproc", "2"],  # argparse takes a prefix
    ]
    not_launching = [
        ["train", "c.yaml"],
        ["prepare", "c.yaml", "--nproc-per-node", "2"],
        ["config", "c.yaml"],
        ["--version"],
        [],
    ]
    try:
        for argv in launching:
            assert STOP.block_for_launcher(argv), argv
            assert set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_SETMASK, before)
        for argv in not_launching:
            assert not STOP.block_for_launcher(argv), argv
        monkeypatch.setenv("RANK", "0")
        assert not STOP.block_for_launcher(launching[0])
        assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
