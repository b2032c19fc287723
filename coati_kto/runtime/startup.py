"""The cyclic garbage collector held off while a ``coati-kto`` process imports its modules.

Starting a rank imports torch, transformers, ColossalAI and their dependencies: hundreds of thousands of objects
the collector tracks, and with the default thresholds it runs full collections over the growing heap again
and again while they are made. That was 1.0 of the 4.4 CPU-seconds of ``import coati_kto.recipe.train,
colossalai.booster`` on a 2-core AMD EPYC (the same imports after ``gc.disable()``: 3.4), paid by every rank,
launcher and command of a run.

``hold_collection`` (the process's entry point, ``coati_kto.cli.entry``, only) turns the collector off.
``release_collection`` (once the command's imports are done: in the training recipe before setup builds
anything, in the launcher before torchrun starts the workers, before prepare, precompute or export do their
work) freezes every object alive (``gc.freeze``: modules, classes and functions, which live as long as the
process; later collections skip them) and turns the collector back on. Nothing large is made while it is off,
and reference counting frees objects all along: what waits is import-time garbage in reference cycles (about
13,000 objects, a few MB), which the freeze keeps.

A process that did not start through ``entry`` (library use, the test suite's worker ranks) is untouched:
``release_collection`` then does nothing.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable

_held = False  # whether hold_collection turned the collector off (and release_collection has not run yet)


def hold_collection() -> None:
    """Turn the cyclic collector off until ``release_collection`` (a process's entry point calls this first)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release_collection() -> None:
    """Freeze what is alive and turn the collector back on, if ``hold_collection`` turned it off; else nothing.
    Safe to call more than once."""
    global _held
    if not _held:
        return
    _held = False
    gc.freeze()
    gc.enable()


def closed_stdout_is_quiet(run: Callable[[], int]) -> int:
    """``run()``; where the reader of stdout left early (``coati-kto inspect CONFIG | head``), the exit status a
    shell tool gives, 141 (128 + SIGPIPE), without a traceback. Python's recipe: stdout is pointed at
    /dev/null, so the flush at exit does not raise again."""
    try:
        return run()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
