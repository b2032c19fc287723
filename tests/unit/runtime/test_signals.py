"""Ctrl-C twice aborts even when both arrive while the main thread is inside C (coati_kto.runtime.signals).

Python runs a handler once for all the deliveries that came while the main thread was in C code: a rank blocked
in a gloo collective saw Ctrl-C twice as one, stopped cleanly while its peer aborted, and the launch exited 1
instead of 130 (seen in test_operations' signals test at load 12). The stop handlers now count deliveries
through the interpreter's wakeup fd."""

from __future__ import annotations

import os
import subprocess
import sys

from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP_EXIT_CODE

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


def _run(sends: int, saved: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    return subprocess.run(
        [sys.executable, "-c", PROBE % (sends, saved)], env=env, capture_output=True, text=True, timeout=120
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
