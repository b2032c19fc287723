"""The launcher's stop signals: taken by a thread of their own, never by a handler raising in the main thread
(launchers and schedulers deliver a signal more than once, and it can come during any import)."""

from __future__ import annotations

import signal
import subprocess
import sys

from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP_EXIT_CODE

_CHECKS = """
import os, signal, sys, time
from coati_kto.launch import torchrun

def checks():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # GNU timeout, kill -- -PGID and scancel deliver one signal twice
    while not torchrun._WATCH.received:  # the watch's thread took it (no handler ran here)
        time.sleep(0.01)
    import email.mime.text  # noqa: F401 - an import after the signal: nothing is raised inside it
    print("the checks ran to their end", flush=True)

sys.exit(torchrun.before_workers(checks) or 0)
"""


def _probe(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_stop_during_the_checks_before_launch_ends_them_between_steps_in_one_line() -> None:
    """`coati-kto train --nproc-per-node N` runs the config checks and the preflight (seconds of imports) before
    torchrun starts. Its handler raised from inside them: torch's C code swallowed the exception (the stop lost,
    the whole run trained), or it came out as "ImportError: cannot load module more than once per process" or
    "Error importing huggingface_hub.hf_api: SIGTERM". The checks now run on; the stop is one line after them."""
    done = _probe(_CHECKS)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout + done.stderr
    assert done.stdout == "the checks ran to their end\n"
    assert done.stderr == "launcher: stopped by SIGTERM before the workers started\n"


_LATE_WORKERS = """
import os, signal, subprocess, sys, time
from coati_kto.launch import torchrun

torchrun._WATCH.start()
os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning during the checks: the workers'
while not torchrun._WATCH.received:
    time.sleep(0.01)
torchrun._WATCH.to_workers()  # torchrun is starting them
os.kill(os.getpid(), signal.SIGTERM)  # before the workers exist
while len(torchrun._WATCH.received) < 2:
    time.sleep(0.01)
# A worker started now inherits the blocked signals (the default action would kill it): it waits for both.
worker = "import signal; print(sorted(signal.sigwait({signal.SIGTERM, signal.SIGUSR1}).name for _ in range(2)))"
done = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=60)
print(done.returncode, done.stdout.strip(), torchrun._WATCH.relayed)
"""


def test_stop_signals_before_the_workers_exist_reach_them_once_they_do() -> None:
    """A SIGTERM while torchrun started the workers (no worker yet, or one not yet at its handlers) stopped the
    launch with a traceback or killed the rank as it started ("rank 0 failed with signal SIGTERM", exit 1).
    The launcher starts the workers with the stop signals blocked and sends what came before them as they
    appear: pending in the rank until its handlers are in (coati_kto.cli.main), then a clean stop."""
    done = _probe(_LATE_WORKERS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "0 ['SIGTERM', 'SIGUSR1'] True\n", done.stderr


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


def test_a_rank_killed_by_a_relayed_stop_signal_as_it_left_is_part_of_the_stop() -> None:
    """SIGTERM, then a second SIGTERM or Ctrl-C as the ranks exited 75: one rank, in its interpreter's teardown
    (its handlers back to the default action), died of it, and the launch exited 1 with "rank 0 failed with
    signal SIGINT". The ranks now ignore stop signals once they have their exit status; and a death by a stop
    signal this launcher relayed counts as part of the stop. Not one it did not relay: that is a failure."""
    from types import SimpleNamespace

    from coati_kto.launch.torchrun import _failure_lines

    def failed(*codes: int) -> SimpleNamespace:
        failures = {
            r: SimpleNamespace(exitcode=c, local_rank=r, signal_name=lambda: "SIGINT")
            for r, c in enumerate(codes)
        }
        return SimpleNamespace(failures=failures)

    for death in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGUSR1):
        assert _failure_lines(failed(STOP_EXIT_CODE, death), relayed=True) == ([], STOP_EXIT_CODE)
        assert _failure_lines(failed(ABORT_EXIT_CODE, death), relayed=True) == ([], ABORT_EXIT_CODE)
    lines, code = _failure_lines(failed(STOP_EXIT_CODE, -signal.SIGINT))
    assert code == 1 and lines[1].endswith("failed with signal SIGINT")
    lines, code = _failure_lines(failed(-signal.SIGTERM), relayed=True)  # no rank said it stopped: a failure
    assert code == 1 and len(lines) == 1


_MERGED_CTRL_C = """
import os, signal, subprocess, sys, time
from coati_kto.launch import torchrun

torchrun._WATCH.start()
torchrun._WATCH.to_workers()
# The worker starts with the stop signals blocked (inherited): both SIGINTs reach it while it has not run, and
# merge into one pending signal, as in a rank the kernel did not schedule between the launcher's two sends.
worker = '''
import signal, sys, time
count = []
signal.signal(signal.SIGINT, lambda s, f: count.append(s))
print("ready", flush=True)
time.sleep(0.6)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
deadline = time.monotonic() + 2.0
while time.monotonic() < deadline and len(count) < 2:
    time.sleep(0.02)
print(len(count), flush=True)
'''
proc = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True)
assert proc.stdout.readline() == "ready\\n"
for sent in (1, 2):  # one at a time: the launcher takes (and sends) each, as Ctrl-C twice at a terminal
    os.kill(os.getpid(), signal.SIGINT)
    while torchrun._WATCH.received.count(signal.SIGINT) < sent:
        time.sleep(0.01)
print(proc.stdout.readline().strip(), flush=True)
proc.wait(timeout=30)
torchrun._WATCH.close()
"""


def test_a_second_ctrl_c_merged_in_a_busy_worker_still_reaches_it() -> None:
    """From a CI run under load: the launcher sent the two SIGINTs back to back, and a rank the kernel had not run
    in between got them as one (a pending standard signal is not queued twice). It stopped cleanly while its
    peer aborted, failed as "a peer gone" and the launch exited 1, not 130. The launcher now sends the second
    again for a moment: the worker sees two."""
    done = _probe(_MERGED_CTRL_C)
    assert done.returncode == 0, done.stdout + done.stderr
    assert int(done.stdout.strip()) >= 2, done.stdout + done.stderr
