"""Stop requests: SIGTERM, SIGINT and SIGUSR1 end a run cleanly, after the current optimizer step.

Every rank installs the handlers (``StopSignals.install``, at train start). A signal only sets a flag; the
ranks agree on it through the step's metric all-reduce (``vote`` adds two keys, ``decide`` reads them back),
so they all finish the same step, write one checkpoint and raise ``TrainingStoppedError``. Repeated SIGTERM /
SIGUSR1 are harmless (launchers and SLURM may deliver one signal twice); a second SIGINT (Ctrl-C twice)
aborts at once with one line and exit status ``ABORT_EXIT_CODE``, no traceback, nothing saved; once the stop's
checkpoint is complete (``stop_saved``), it exits at once with ``STOP_EXIT_CODE``: the stop is done.

A launcher blocks the stop signals from its first step (``block_for_launcher``; coati_kto.launch.torchrun takes
them), so its ranks start with them blocked: ``start_rank`` unblocks them once the handlers are in. Once a
process has its exit status they are ignored (``ignore_from_now``).

precompute and export have no step to finish and nothing to resume: there a stop signal ends the command at once
(``quit_on_stop``): the command's own cleanup runs (``stoppable``), a commit in progress completes first
(``held``), then one line says what it leaves (``leaves``) and the process exits 128 + the signal (143 for
SIGTERM, 130 for SIGINT), without a traceback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import NoReturn, TypeVar

T = TypeVar("T")

# EX_TEMPFAIL (sysexits.h): "temporary failure, try again". Every rank and our launchers exit with it after
# a clean stop; schedulers and wrapper scripts can tell "stopped, resume me" from a crash.
STOP_EXIT_CODE = 75
ABORT_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports an interrupted command
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_LAUNCHING = ("train", "precompute", "export")  # the commands that run torchrun with --nproc-per-node
# no step to finish, nothing to resume: a stop ends them at once, after their cleanup (a scratch folder removed)
QUITTING = ("precompute", "export", "prepare", "inspect")
# one-process commands that write nothing: a stop ends them at once from the process's first step (entry). A
# Ctrl-C raised as KeyboardInterrupt was lost where it landed in torch's import of numpy (torch's C code clears
# the error): the half-imported numpy then failed transformers' next import, and plan said "error: model.path:
# ... transformers cannot build its config.json", exit 2; SIGUSR1 and SIGTERM had the default action.
READING = ("plan", "config")
# tiny-model writes its folder through durable.write_dir (whole, or as it was): a stop quits it as it does those
# (SIGTERM and SIGUSR1 had the default action)
ALONE = (*QUITTING, *READING, "tiny-model")
_VOTE_COUNT, _VOTE_SIGNAL = "stop/requested", "stop/signal"


class TrainingStoppedError(Exception):
    """Raised on every rank after the checkpoint of a stop request; the CLI prints ``message`` (rank 0) and
    exits with STOP_EXIT_CODE."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None) -> None:
        saved = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (no checkpoint manager)"
        super().__init__(
            f"stopped by {signal_name} after step {step}; {saved}; resume with train.resume=auto"
        )
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class CommandStoppedError(BaseException):
    """A stop signal inside ``StopSignals.stoppable`` (precompute, export), raised once in the main thread: the
    stack unwinds through the command's own cleanup (finally blocks: scratch folders, temporary files), then
    ``stoppable`` ends the process. A BaseException, so that no ``except Exception`` of the command's takes it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopSignals:
    """The process-wide stop flag. ``install`` on every rank, in the main thread, for the rest of the process."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal's number
        # a Ctrl-C before the run's handlers (``_interrupt``): its KeyboardInterrupt may have been swallowed
        self.interrupted = False
        self.stop_saved: str | None = None  # the stop's complete checkpoint, once written (``stopped_with``)
        self._deliveries: tuple[int, int] | None = None  # the wakeup pipe (read end, write end), once made
        self._counting = False
        # quit_on_stop's: the command named in its line, what a stop leaves now, inside stoppable / held, leaving
        self._command = "coati-kto"
        self._outcome: str | Callable[[], str] = "nothing written"
        self._scope = self._held = 0
        self._leaving = False

    def install(self) -> StopSignals:
        """Idempotent; returns self. Raises KeyboardInterrupt when a Ctrl-C came before (``_interrupt``) and a
        library swallowed it: the command ends as interrupted, before anything trains."""
        if self.interrupted:
            raise KeyboardInterrupt
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        self._count_deliveries()
        return self

    def start_rank(self, train: bool) -> None:
        """A rank's first step (the CLI, main thread): the handlers for train (or ``quit_on_stop`` for precompute
        and export, told by the command line, ``sys.argv``), then the stop signals unblocked. coati_kto.launch starts its ranks
        with them blocked, so one that came before the handlers is pending and counts now (a clean stop), where
        the default action killed the rank as it started (the launch: exit 1, "rank 1 failed with signal
        SIGTERM"). Other commands' ranks get the default action, as before."""
        if train:
            self.install()
        elif (command := command_of(sys.argv[1:])) in QUITTING:
            self.quit_on_stop(command)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def block_for_launcher(self, argv: list[str]) -> bool:
        """The process's first step (``coati_kto.cli.entry``): when ``argv`` runs torchrun (train, precompute or
        export with ``--nproc-per-node``, not in a rank), block the stop signals, for coati_kto.launch.torchrun's
        watch to take; True then. Before this a SIGTERM is the default action's silent exit 143. Told before
        argparse (imports) runs: the command is the first word that is no option, and an option may be an
        unambiguous prefix (``--nproc 2``). A command in this process alone (no launcher, not a rank) gets its
        stop handlers here instead (``_one_process``; False): its imports take seconds."""
        command = command_of(argv)
        options = {arg.split("=")[0] for arg in argv if arg.startswith("--")}
        if "RANK" in os.environ:
            return False
        nproc = any(len(option) > 2 and "--nproc-per-node".startswith(option) for option in options)
        if command not in _LAUNCHING or not nproc:
            self._one_process(command)
            return False
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        return True

    def _one_process(self, command: str | None) -> None:
        """The stop signals of a command run in this process alone (no launcher, not a rank), from its first
        step: precompute, export, prepare, inspect, plan, config and tiny-model quit (``quit_on_stop``: one line,
        128 + the signal). Elsewhere (train until its handlers, no command yet) a Ctrl-C is recorded as it raises
        KeyboardInterrupt (``_interrupt``), and train keeps a SIGTERM or SIGUSR1 (a scheduler's stop, SLURM's
        warning; their default action killed the process, 143 with no line) for its first step, as a launcher
        keeps them for its ranks: a checkpoint, exit 75."""
        if command in ALONE:
            self.quit_on_stop(command)
            return
        signal.signal(signal.SIGINT, self._interrupt)
        if command == "train":
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, self._handle)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        """Python's own Ctrl-C (KeyboardInterrupt), recorded: where a library swallows the exception (torch's
        import of numpy), the error that follows is reported as the interrupt, and ``install`` raises it again."""
        self.interrupted = True
        raise KeyboardInterrupt

    @staticmethod
    def ignore_from_now() -> None:
        """The process has its exit status (``coati_kto.cli.entry``, once ``main`` returned): a stop signal can
        change nothing now, and must not kill it on its way out.

        SIG_IGN, not a blocked mask: a disposition holds for every thread (a signal to the process goes to any
        thread that does not block it: gloo's, a writer's), and interpreter finalization keeps SIG_IGN where it
        resets every Python handler to the default action. A SIGTERM repeated as the ranks left killed one there
        (-15 after its "exit 75") and the launch exited 1 instead of 75; a second Ctrl-C, the same."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _count_deliveries(self) -> None:
        """Have the interpreter write one byte per delivered signal to a pipe (``signal.set_wakeup_fd``).

        Python runs a handler once for all the deliveries that came while the main thread was inside C: a rank
        blocked in a gloo collective took Ctrl-C twice as one and stopped cleanly, while its peer aborted, and
        the launch exited 1, not 130. The pipe counts the deliveries. It stays for the process. Where something
        else already set a wakeup fd (an event loop), that one is kept and handler calls are counted as before."""
        if self._deliveries is None:
            read_end, write_end = os.pipe()
            os.set_blocking(read_end, False)
            os.set_blocking(write_end, False)
            self._deliveries = (read_end, write_end)
        previous = signal.set_wakeup_fd(self._deliveries[1], warn_on_full_buffer=False)
        self._counting = previous in (-1, self._deliveries[1])
        if not self._counting:
            signal.set_wakeup_fd(previous)
        self._drain()  # bytes of signals delivered before this install (under other handlers) are not ours

    def _drain(self) -> bytes:
        """The signal numbers written to the pipe since the last drain, one byte per delivery."""
        if self._deliveries is None:
            return b""
        chunks = []
        try:
            while chunk := os.read(self._deliveries[0], 512):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        return b"".join(chunks)

    def _delivered(self, signum: int) -> int:
        """How many times ``signum`` was delivered since the last drain (at least once: its handler runs)."""
        return max(self._drain().count(signum), 1) if self._counting else 1

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        twice = signum == signal.SIGINT and self._delivered(signum) >= 2
        if signum == signal.SIGINT and (self.received == signal.SIGINT or twice):
            # Ctrl-C twice: the user wants out now. os._exit skips every finally block and atexit hook that
            # could block (a collective, a half-written checkpoint); the next save removes the partial one.
            # After the stop's checkpoint (the ranks may still be waiting on uploads) nothing is lost: 75.
            saved, code = self.stop_saved, STOP_EXIT_CODE if self.stop_saved else ABORT_EXIT_CODE
            if os.environ.get("RANK", "0") == "0":
                line = (
                    f"a second SIGINT: exiting now; the stop's checkpoint {saved} is complete; resume with "
                    "train.resume=auto\n"
                    if saved
                    else "aborted by a second SIGINT: nothing saved since the last checkpoint\n"
                )
                os.write(2, line.encode())
            sys.stderr.flush()
            os._exit(code)
        if self.received is None:
            self.received = signum
            if os.environ.get("RANK", "0") == "0":
                name = signal.Signals(signum).name
                # os.write, not print: a handler may run while print holds stdout's lock (reentrancy).
                os.write(
                    2,
                    f"{name} received: stopping after the current optimizer step "
                    f"(checkpoint, then exit {STOP_EXIT_CODE}); Ctrl-C again to abort at once\n".encode(),
                )

    def stopped_with(self, checkpoint: str | None) -> None:
        """The stop's checkpoint is complete (every rank, after its save): a second Ctrl-C now exits 75."""
        self.stop_saved = checkpoint

    def vote(self) -> dict[str, float]:
        """This rank's part of the stop vote: two keys to add to the step's all-reduced sums."""
        return {_VOTE_COUNT: float(self.received is not None), _VOTE_SIGNAL: float(self.received or 0)}

    # ------------------------------------------------------------------- commands without a safe point to stop
    def quit_on_stop(self, command: str) -> None:
        """From now on (main thread, for the rest of the process) a stop signal ends ``command`` (precompute,
        export): at once outside ``stoppable``; inside it, by CommandStoppedError, once the command's cleanup has
        run; after a commit in progress (``held``). Global rank 0 prints ``COMMAND stopped by SIGTERM: <what it
        leaves>`` (``leaves``); the exit status is 128 + the signal. A repeated signal changes nothing."""
        self._command, self._leaving = command, False
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._quit)

    def leaves(self, outcome: str | Callable[[], str]) -> None:
        """What a stop from now on leaves on disk, for its line (a callable is asked when the stop ends the
        process: it looks at the disk)."""
        self._outcome = outcome

    def stoppable(self, work: Callable[[], T]) -> T:
        """``work()``, the command (precompute, export); returns its result. Under ``quit_on_stop`` a stop signal
        raises CommandStoppedError inside it, and once the stack has unwound through the command's cleanup the
        process ends (one line, exit 128 + the signal), whatever exception came out. Without (a library call,
        train's handlers) it is ``work()``."""
        self._scope += 1
        try:
            try:
                result = work()
            finally:
                # From here a signal ends the process from its handler: raised now, it would escape the command.
                self._scope -= 1
        except BaseException:
            self._settle()
            raise
        self._settle()  # a stop whose exception a library swallowed: the work is done, the stop still counts
        return result

    def held(self) -> _Held:
        """A context in which a stop signal waits (a commit: renames that put complete output in place); it takes
        effect at the context's end, or at its start when one came before and is still unanswered."""
        return _Held(self)

    def _quitting(self) -> bool:
        return signal.getsignal(signal.SIGTERM) == self._quit

    def _quit(self, signum: int, frame: FrameType | None) -> None:
        if self._leaving:
            return
        first = self.received is None
        if first:
            self.received = signum
        if self._held:
            return  # the commit finishes first; its end acts on the signal
        if not self._scope:
            self._leave()  # before the command or after it: nothing of its own to unwind
        # A repeat while the stop's exception unwinds the stack (a finally block removing a scratch folder) must
        # not cut that cleanup short; one after a library swallowed the exception raises it again.
        if first or not _unwinding():
            raise CommandStoppedError(self.received or signum)

    def _settle(self) -> None:
        """The command left ``stoppable`` (or a hold ended outside it): a stop that came ends the process now."""
        if self.received is not None and self._quitting():
            self._leave()

    def _leave(self) -> NoReturn:
        """One line on global rank 0, then exit 128 + the signal. os._exit: nothing is left to run (the command's
        cleanup did), and the interpreter's teardown could block on a peer gone (a process group's threads)."""
        self._leaving = True
        signum = self.received or signal.SIGTERM
        try:
            outcome = self._outcome() if callable(self._outcome) else self._outcome
        except Exception:  # noqa: BLE001 - the disk it looks at is gone or unreadable: say less, still exit
            outcome = "see the command's output above"
        if os.environ.get("RANK", "0") == "0":
            name = signal.Signals(signum).name
            os.write(2, f"{self._command} stopped by {name}: {outcome}\n".encode())
        for stream in (sys.stdout, sys.stderr):  # a handler may run while print holds one (reentrant flush)
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)


class _Held:
    """``StopSignals.held``: a stop signal inside waits for the end, where ``__exit__`` raises it from the
    ``with`` line, inside the command's own try blocks (their cleanup runs)."""

    def __init__(self, owner: StopSignals) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        if self.owner.received is not None and self.owner._quitting() and not _unwinding():
            raise CommandStoppedError(self.owner.received)  # a stop a library swallowed: commit nothing
        self.owner._held += 1

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        owner = self.owner
        owner._held -= 1
        if owner._held or owner.received is None or not owner._quitting() or kind is not None:
            return
        if not owner._scope:
            owner._leave()
        raise CommandStoppedError(owner.received)  # the commit is complete: now the stop


def _unwinding() -> bool:
    """Whether this thread is handling a CommandStoppedError (an except or finally block, a context's exit, on
    its way out), directly or as the cause of the exception it handles."""
    err = sys.exc_info()[1]
    while err is not None:
        if isinstance(err, CommandStoppedError):
            return True
        err = err.__context__
    return False


def launches(command: str, nproc_per_node: int | None) -> bool:
    """Whether ``command`` starts torchrun itself (``--nproc-per-node N``; the CLI). A process with RANK set already
    is a rank of a launcher (torchrun, srun, colossalai run, or a shell that leaked RANK): there the option was
    ignored (one process, not a word); it is refused now: UserError, one line, exit 2."""
    if command not in _LAUNCHING or not nproc_per_node:
        return False
    if "RANK" in os.environ:
        from coati_kto.errors import UserError

        raise UserError(
            f"--nproc-per-node {nproc_per_node} starts its own ranks, but RANK={os.environ['RANK']} is set (this "
            "process already is a rank of a launcher: torchrun, srun): drop --nproc-per-node or unset RANK"
        )
    return True


def command_of(argv: list[str]) -> str | None:
    """The command of a coati-kto command line: its first word that is no option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


# The process's one instance: the CLI installs it before its heavy imports (SIGUSR1's default action kills a
# process that has not installed a handler yet, and a warning can arrive while a rank is still starting).
STOP = StopSignals()


def decide(totals: dict[str, float]) -> str | None:
    """Pop the vote's keys from the reduced ``totals``; the signal's name when any rank asked to stop.

    Every rank gets the same answer (same reduced sums). Different signals on different ranks are named
    "a stop signal" (their numbers were summed).
    """
    count, summed = totals.pop(_VOTE_COUNT, 0.0), totals.pop(_VOTE_SIGNAL, 0.0)
    if count < 1:
        return None
    mean = summed / count
    if mean.is_integer() and int(mean) in {int(s) for s in STOP_SIGNALS}:
        return signal.Signals(int(mean)).name
    return "a stop signal"
