"""``python -m coati_kto.launch [torchrun options] -m coati_kto train CONFIG ...``: torchrun, with the project's
signal handling and failure reporting. Every launch path goes through it (``coati-kto train --nproc-per-node``,
launch/torchrun.sh, launch/slurm.sbatch, and launch/colossalai_run.sh through launch/bin/torchrun).

What it changes, and why:
- SIGTERM, SIGINT and SIGUSR1 are forwarded to the local workers as they are, once each (torchrun itself would
  forward them, wait 30 s, SIGKILL the workers mid-checkpoint, print a traceback and exit 1; and it does not
  handle SIGUSR1, SLURM's warning signal, at all: its default action kills the launcher). The workers vote,
  finish the step, checkpoint and exit with STOP_EXIT_CODE; so does this launcher. A second SIGINT reaches the
  workers as a second SIGINT: they abort at once (ABORT_EXIT_CODE).
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
from collections.abc import Callable
from types import FrameType

import psutil

from coati_kto.errors import PUSH_FAILED_EXIT_CODE, USER_ERROR_EXIT_CODE
from coati_kto.runtime.signals import ABORT_EXIT_CODE, PENDING_STOP_ENV, STOP_EXIT_CODE, STOP_SIGNALS

DEFAULT_RDZV_TIMEOUT_S = 90


class _StoppedBeforeWorkersError(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _forward(signum: int, frame: FrameType | None) -> None:
    """Send ``signum`` to this process's direct children: torchrun's workers (each in its own session, so
    nothing else reaches them). With no worker yet, stop the launch itself.

    Imports nothing: GNU timeout, ``kill -- -PGID`` and scancel deliver a signal more than once, and a second
    one arriving while the first handler imported psutil left the module half-initialised (exit 1, not 75)."""
    workers = psutil.Process().children(recursive=False)
    if not workers and signum == signal.SIGUSR1:
        # A warning (SLURM's --signal) before the workers exist: they inherit it and stop after their first step.
        os.environ[PENDING_STOP_ENV] = str(signum)
        return
    if not workers:
        raise _StoppedBeforeWorkersError(signum)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signum)


def _with_defaults(argv: list[str]) -> list[str]:
    options = {arg.split("=")[0].replace("_", "-") for arg in argv if arg.startswith("--")}
    static = (
        "--standalone" not in options and "--rdzv-backend" not in options and "--rdzv-endpoint" not in options
    )
    if static and "--rdzv-conf" not in options:
        timeout = int(os.environ.get("COATI_KTO_RDZV_TIMEOUT", DEFAULT_RDZV_TIMEOUT_S))
        return [f"--rdzv-conf=timeout={timeout}", *argv]
    return argv


def _failure_lines(err: BaseException) -> tuple[list[str], int]:
    """(one line per failed worker, the exit status this launcher returns)."""
    failures = getattr(err, "failures", {})
    codes = {f.exitcode for f in failures.values()}
    # A clean stop; torchrun SIGTERMs the workers still exiting once the first one has, so -SIGTERM is one too.
    if STOP_EXIT_CODE in codes and codes <= {STOP_EXIT_CODE, -signal.SIGTERM}:
        return [], STOP_EXIT_CODE
    # Ctrl-C twice: a rank past the stop's checkpoint exits 75, one still before it 130; the abort is what happened.
    if ABORT_EXIT_CODE in codes and codes <= {ABORT_EXIT_CODE, STOP_EXIT_CODE, -signal.SIGTERM}:
        return [], ABORT_EXIT_CODE
    # A user mistake found in the ranks (resume, output.dir in use): they printed its one line and exited 2.
    if USER_ERROR_EXIT_CODE in codes and codes <= {USER_ERROR_EXIT_CODE, -signal.SIGTERM}:
        return [], USER_ERROR_EXIT_CODE
    if codes == {PUSH_FAILED_EXIT_CODE}:  # rank 0 trained, saved, and printed why its upload failed
        return [], PUSH_FAILED_EXIT_CODE
    host = socket.gethostname()
    lines = []
    for rank, failure in sorted(failures.items()):
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        lines.append(f"launcher: rank {rank} (local rank {failure.local_rank}) on {host} failed with {how}")
    return lines, 1


def before_workers(checks: Callable[[], None]) -> int | None:
    """Run ``checks`` (config, preflight: seconds of imports) under the launcher's signal handling; returns the
    exit status when a stop signal ended them (one line), else None. SIGUSR1 stays pending for the workers."""
    previous = {sig: signal.signal(sig, _forward) for sig in STOP_SIGNALS}
    try:
        checks()
        return None
    except _StoppedBeforeWorkersError as err:
        print(f"launcher: stopped by {err} before the workers started", file=sys.stderr, flush=True)
        return 128 + err.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` (its own options and the worker command); returns the exit status."""
    previous = {
        sig: signal.signal(sig, _forward) for sig in STOP_SIGNALS
    }  # first: torch takes seconds to import
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from coati_kto.runtime.startup import release_collection

    release_collection()  # the launcher's imports are done; it now watches its workers for the whole run

    argv = list(sys.argv[1:] if argv is None else argv)
    # Its per-worker log lines ("Sending process ... closing signal", "failed (exitcode: 75)") are replaced by
    # the one line per failed rank below.
    for name in (
        "torch.distributed.elastic.multiprocessing.api",
        "torch.distributed.elastic.agent.server.api",
    ):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    # torchrun keeps SIGHUP/SIGQUIT (it tears the workers down); the stop signals are ours (see above).
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    try:
        torchrun.run(torchrun.parse_args(_with_defaults(argv)))
        return 0
    except ChildFailedError as err:
        lines, code = _failure_lines(err)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        return code
    except _StoppedBeforeWorkersError as err:
        print(f"launcher: stopped by {err} before the workers started", file=sys.stderr, flush=True)
        return 128 + err.signum
    except Exception as err:  # rendezvous / store failures: torchrun's message, on one line
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(
            f"launcher on {socket.gethostname()}: {type(err).__name__}: {first}", file=sys.stderr, flush=True
        )
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
