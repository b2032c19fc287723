"""One writer per target directory (an export, ``final/``), held by a lock for as long as the writing process lives.

``durable.write_dir`` writes a target in ``.NAME.coati-kto-new-XXXXXXXX`` beside it, after its ``recover`` removed
every such leftover of that target. Two processes writing one target at once (two ``coati-kto export`` to one
--out: a command re-run, two CI jobs) both passed export's "target exists" check; the second's ``recover`` deleted
the first's directory mid-write (a raw traceback, or files written into a deleted directory), or its rename
replaced the first's finished export without a word.

The writer holds an exclusive ``flock`` on ``.NAME.coati-kto.lock`` beside the target (as the run lock and
``data.build_folder`` do): the kernel drops it when the process dies, however it dies, and whatever its host (NFS
keeps such locks on its server). The file names its holder, for the refusal's line; the holder removes it on
release (a killed one's stays, unheld: the next writer takes it). Held again by the same process, it nests. A file
system that refuses ``flock`` is written unlocked, as before. The taking, the holder's line and the probe are
``coati_kto.locks``'s, shared with the run lock and ``data.prepared_lock``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from coati_kto.errors import UserError
from coati_kto.locks import locked, probe, remove_and_unlock, write_holder

# A probe (``holder``) holds a shared lock for a moment: a writer finding the lock taken tries again this long
# before it calls the target busy.
_PROBE_GRACE_S = 1.0
# target (its parent resolved) -> (the descriptor holding its lock, how many nested holds)
_HELD: dict[Path, tuple[int, int]] = {}
_GUARD = threading.Lock()


class TargetBusyError(UserError):
    """Another live process holds the lock of ``target``: it is writing it (``holder`` names it)."""

    def __init__(self, target: Path, holder: str) -> None:
        super().__init__(f"{target} is being written by another process ({holder})")
        self.target, self.holder = target, holder


def lock_path(target: Path) -> Path:
    """The lock file of ``target``: beside it, a name no ``own_dir`` or user folder has."""
    return target.parent / f".{target.name}.coati-kto.lock"


def _key(target: Path) -> Path:
    return target.parent.resolve() / target.name


def _lock(path: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive flock; None where the file system refuses flock. Raises
    BlockingIOError holding the holder's line while another process holds it past the grace (a probe's moment),
    OSError when it cannot be made."""
    deadline = time.monotonic() + _PROBE_GRACE_S
    while True:
        try:
            return locked(path)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def take(target: Path, what: str) -> None:
    """Hold ``target``'s lock until :func:`release` (nested holds count). ``what`` (``coati-kto export of
    step-4``) is written in the lock file with this pid, host and time. Raises TargetBusyError when another live
    process holds it; OSError when the lock file cannot be made (the target's folder cannot be written)."""
    key = _key(target)
    with _GUARD:
        if key in _HELD:
            fd, depth = _HELD[key]
            _HELD[key] = (fd, depth + 1)
            return
        try:
            fd = _lock(lock_path(target))
        except BlockingIOError as err:
            raise TargetBusyError(target, str(err)) from None
        if fd is None:
            return
        write_holder(fd, what)
        _HELD[key] = (fd, 1)


def release(target: Path) -> None:
    """The end of one :func:`take` of ``target``; the last removes the lock file, then unlocks it (removed while
    held: a writer that opened it meanwhile sees it gone and takes a new one)."""
    key = _key(target)
    with _GUARD:
        if key not in _HELD:  # a file system without flock: nothing was held
            return
        fd, depth = _HELD.pop(key)
        if depth > 1:
            _HELD[key] = (fd, depth - 1)
            return
        remove_and_unlock(fd, lock_path(target))


@contextlib.contextmanager
def held(target: Path, what: str) -> Iterator[None]:
    """``target``'s lock held for the block (:func:`take`, :func:`release`)."""
    take(target, what)
    try:
        yield
    finally:
        release(target)


def holder(target: Path) -> str | None:
    """Who holds ``target``'s lock, when another process does (its line from the lock file); None when nobody
    does, this process does, or the file system has no locks."""
    return None if _key(target) in _HELD else probe(lock_path(target))
