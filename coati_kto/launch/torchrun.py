"""``python -m coati_kto.launch [torchrun options] -m coati_kto train CONFIG ...``: torchrun, with the project's
signal handling and failure reporting. Every launch path goes through it (``coati-kto train --nproc-per-node``,
launch/torchrun.sh, launch/slurm.sbatch, and launch/colossalai_run.sh through launch/bin/torchrun).

What it changes, and why:
- SIGTERM, SIGINT and SIGUSR1 are forwarded to the local workers as they are, once each (torchrun itself would
  forward them, wait 30 s, SIGKILL the workers mid-checkpoint, print a traceback and exit 1; and it does not
  handle SIGUSR1, SLURM's warning signal, at all: its default action kills the launcher). The workers vote,
  finish the step, checkpoint and exit with STOP_EXIT_CODE; so does this launcher. A second SIGINT reaches the
  workers as a second SIGINT: they abort at once (ABORT_EXIT_CODE). precompute's and export's workers have no
  step to finish: they remove what they were writing and exit 128 + the signal, and so does this launcher.
- No handler ever runs in the launcher's main thread: the stop signals are blocked there from the start (so in
  every thread and worker it starts) and one thread takes them (``_Watch``). A handler raising to stop the
  launch landed inside imports, where torch's and huggingface_hub's code swallowed or printed it (a stop lost,
  "cannot load module more than once per process"). Before the workers, a SIGTERM or SIGINT is looked at
  between the launcher's steps; once torchrun starts them, each stop signal goes to the workers, and one that
  comes before they exist is sent to them as they appear. They start with the signals blocked, so one that
  arrives before a rank installs its handlers waits for them (a clean stop) instead of killing it.
- The static rendezvous (multi-node, ``--master_addr``) gives up after COATI_KTO_RDZV_TIMEOUT seconds (default
  90) instead of torchrun's 600, so a node that never arrives fails the launch in about two minutes.
- A worker failure is one line per failed rank, naming the rank, this host and the exit code or signal, instead
  of torchrun's report block; the workers' own one-line errors are above it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import psutil

from coati_kto.errors import PUSH_FAILED_EXIT_CODE, USER_ERROR_EXIT_CODE
from coati_kto.runtime.signals import ABORT_EXIT_CODE, STOP_EXIT_CODE, STOP_SIGNALS

DEFAULT_RDZV_TIMEOUT_S = 90
_POLL_S = 0.1  # how often the signal thread looks for workers to send a stop to (and for the end)
# After the second SIGINT, how long it is sent again to the workers still alive, each poll: two SIGINTs sent back
# to back merge into one in a worker the kernel has not run in between (a busy machine), which then stops
# cleanly while its peers abort, and fails as "a peer gone" (exit 1). Within the ranks' grace for their own
# second SIGINT (coati_kto.cli.ABORT_GRACE_S, 2 s).
_ABORT_RESEND_S = 1.5


class _StoppedBeforeWorkersError(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Watch:
    """The launcher's stop signals: blocked in the main thread from ``start`` (threads and processes it starts
    inherit the mask) and taken by a thread of their own with ``sigtimedwait``. The main thread asks ``check``
    between its steps; ``to_workers`` hands every later signal (and the SIGUSR1 warnings so far) to the workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._mask: set[signal.Signals] = set()
        self._reset()

    def _reset(self) -> None:
        self.received: list[int] = []  # every stop signal, in order of arrival
        self.relayed = False  # a stop signal was meant for the workers (their deaths by one are part of it)
        self._unsent: list[int] = []  # meant for the workers, none of which exists yet
        self._to_workers = False
        self._abort_until: float | None = None  # monotonic time: the second SIGINT is sent again until then

    def start(self) -> bool:
        """Block the stop signals in this (the main) thread and start taking them; True when this call started
        it (its caller closes it), False when it was running. Before any other thread exists: a thread that does
        not block them would get them, with the default action."""
        if self._thread is not None:
            return False
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        self._done.clear()
        self._thread = threading.Thread(target=self._take, name="coati-kto stop signals", daemon=True)
        self._thread.start()
        return True

    def _take(self) -> None:
        while not self._done.is_set():
            info = signal.sigtimedwait(STOP_SIGNALS, _POLL_S)
            with self._lock:
                if info is not None:
                    self.received.append(info.si_signo)
                    if self._to_workers:
                        self._unsent.append(info.si_signo)
                        self.relayed = True
                        if self._abort_until is None and self.received.count(signal.SIGINT) >= 2:
                            self._abort_until = time.monotonic() + _ABORT_RESEND_S
                elif (
                    self._abort_until is not None
                    and time.monotonic() < self._abort_until
                    and not self._unsent
                ):
                    self._unsent.append(signal.SIGINT)  # again: it may have merged with the first in a worker
                if self._unsent:
                    self._send()

    def _send(self) -> None:
        """Send what is unsent to this process's direct children: torchrun's workers (each in its own session,
        so nothing else reaches them). None yet: they are on their way; the next poll sends it."""
        try:
            workers = psutil.Process().children(recursive=False)
        except psutil.Error:  # /proc in flux: the next poll tries again (an exception would end the thread)
            return
        if not workers:
            return
        for signum in self._unsent:
            for worker in workers:
                with contextlib.suppress(psutil.Error):  # gone meanwhile
                    worker.send_signal(signum)
        self._unsent.clear()

    def _first_stop(self) -> int | None:
        return next((s for s in self.received if s != signal.SIGUSR1), None)

    def check(self) -> None:
        """Raise _StoppedBeforeWorkersError if a SIGTERM or SIGINT came (SIGUSR1, a warning, is the workers')."""
        with self._lock:
            first = self._first_stop()
        if first is not None:
            raise _StoppedBeforeWorkersError(first)

    def to_workers(self) -> None:
        """The last ``check``; from here every stop signal is the workers', those so far (SIGUSR1) included."""
        with self._lock:
            first = self._first_stop()
            if first is not None:
                raise _StoppedBeforeWorkersError(first)
            self._unsent, self.relayed, self._to_workers = list(self.received), bool(self.received), True

    def close(self) -> None:
        """Stop taking the signals and unblock them, from the thread that started (tests and library calls: a
        launcher process keeps them blocked to its exit, so that a late one cannot change its exit status)."""
        if self._thread is None:
            return
        self._done.set()
        self._thread.join()
        self._thread = None
        while signal.sigtimedwait(STOP_SIGNALS, 0) is not None:  # came after the thread's last look: dropped
            pass
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        self._reset()


_WATCH = _Watch()


def watch_stops() -> None:
    """Take the stop signals from now on (``coati_kto.cli.entry``, first thing, for a command that launches)."""
    _WATCH.start()


def check_stop() -> None:
    """Between the launcher's steps before torchrun: raise _StoppedBeforeWorkersError if a stop came."""
    _WATCH.check()


def _with_defaults(argv: list[str]) -> list[str]:
    options = {arg.split("=")[0].replace("_", "-") for arg in argv if arg.startswith("--")}
    static = (
        "--standalone" not in options and "--rdzv-backend" not in options and "--rdzv-endpoint" not in options
    )
    if static and "--rdzv-conf" not in options:
        timeout = int(os.environ.get("COATI_KTO_RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT_S))
        return [f"--rdzv-conf=timeout={timeout}", *argv]
    return argv


def _failure_lines(err: BaseException, relayed: bool = False) -> tuple[list[str], int]:
    """(one line per failed worker, the exit status this launcher returns); ``relayed``: this launcher sent the
    workers a stop signal."""
    failures = getattr(err, "failures", {})
    codes = {f.exitcode for f in failures.values()}
    # torchrun SIGTERMs the workers still exiting once the first one has, so -SIGTERM is part of any ending. A
    # rank killed by a stop signal this launcher relayed is part of the stop too: a rank ignores them once it
    # has its exit status (coati_kto.cli.entry), but one that came in the instant before still has that effect.
    ended = {-signal.SIGTERM, *({-int(sig) for sig in STOP_SIGNALS} if relayed else ())}
    if STOP_EXIT_CODE in codes and codes <= {STOP_EXIT_CODE, *ended}:  # a clean stop
        return [], STOP_EXIT_CODE
    # Ctrl-C twice: a rank past the stop's checkpoint exits 75, one still before it 130; the abort is what happened.
    if ABORT_EXIT_CODE in codes and codes <= {ABORT_EXIT_CODE, STOP_EXIT_CODE, *ended}:
        return [], ABORT_EXIT_CODE
    # precompute and export end at once on a stop signal, with 128 + the signal (STOP.quit_on_stop); rank 0 said
    # what they left. Only one this launcher relayed: a rank signalled by someone else failed.
    quits = {128 + int(sig) for sig in STOP_SIGNALS}
    if relayed and codes & quits and codes <= quits | ended:
        return [], next(f.exitcode for _, f in sorted(failures.items()) if f.exitcode in quits)
    # A user mistake found in the ranks (resume, output.dir in use): they printed its one line and exited 2; the
    # others were ended by torchrun's SIGTERM (143 where STOP.quit_on_stop runs: precompute, export).
    torchrun_ended = {-signal.SIGTERM, 128 + signal.SIGTERM}
    if USER_ERROR_EXIT_CODE in codes and codes <= {USER_ERROR_EXIT_CODE, *torchrun_ended}:
        return [], USER_ERROR_EXIT_CODE
    if codes == {PUSH_FAILED_EXIT_CODE}:  # rank 0 trained, saved, and printed why its upload failed
        return [], PUSH_FAILED_EXIT_CODE
    host = socket.gethostname()
    lines = []
    for rank, failure in sorted(failures.items()):
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        lines.append(f"launcher: rank {rank} (local rank {failure.local_rank}) on {host} failed with {how}")
    return lines, 1


def _stopped_before_workers(err: _StoppedBeforeWorkersError) -> int:
    print(f"launcher: stopped by {err} before the workers started", file=sys.stderr, flush=True)
    return 128 + err.signum


def before_workers(checks: Callable[[], None]) -> int | None:
    """Run ``checks`` (config, preflight: seconds of imports; they call ``check_stop`` between their parts) with
    the stop signals taken by the watch; returns the exit status when a SIGTERM or SIGINT came (one line), else
    None. The checks are never interrupted inside; SIGUSR1 is kept for the workers."""
    owner = _WATCH.start()
    try:
        checks()
        _WATCH.check()
        return None
    except _StoppedBeforeWorkersError as err:
        return _stopped_before_workers(err)
    finally:
        if owner:  # not started by the process's entry point (a test): nothing is launched after this
            _WATCH.close()


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (its own options and the worker command); returns the exit status."""
    owner = _WATCH.start()  # first: torch takes seconds to import
    try:
        return _launch(list(sys.argv[1:] if argv is None else argv))
    except _StoppedBeforeWorkersError as err:
        return _stopped_before_workers(err)
    finally:
        # As ``python -m coati_kto.launch`` (argv None) this is the process: the signals stay blocked to its exit.
        if owner and argv is not None:
            _WATCH.close()


def _launch(argv: list[str]) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from coati_kto.runtime.startup import release_collection

    release_collection()  # the launcher's imports are done; it now watches its workers for the whole run

    # Its per-worker log lines ("Sending process ... closing signal", "failed (exitcode: 75)") are replaced by
    # the one line per failed rank below.
    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun keeps SIGHUP/SIGQUIT (it tears the workers down); the stop signals are ours (see above).
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    _WATCH.to_workers()  # the last look before the workers: a stop from here on is theirs
    try:
        torchrun.run(torchrun.parse_args(_with_defaults(argv)))
        return 0
    except ChildFailedError as err:
        lines, code = _failure_lines(err, _WATCH.relayed)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    except Exception as err:  # rendezvous / store failures: torchrun's message, on one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"launcher on {socket.gethostname()}: {type(err).__name__}: {first}", file=sys.stderr, flush=True
        )
        return 1
