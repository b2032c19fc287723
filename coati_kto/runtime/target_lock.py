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
system that refuses ``flock`` is written unlocked, as before.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from coati_kto.errors import UserError

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


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    return ""


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` has open (its holder removes it on release)."""
    try:
        now, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def _lock(path: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive flock; None where the file system refuses flock. Raises
    BlockingIOError holding the holder's line while another process holds it, OSError when it cannot be made."""
    deadline = time.monotonic() + _PROBE_GRACE_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            if time.monotonic() >= deadline:
                raise BlockingIOError(holder or "holder unknown") from None
            time.sleep(0.05)
            continue
        except OSError:  # ENOLCK / EOPNOTSUPP: no locks here, and no lock file left behind either
            os.close(fd)
            path.unlink(missing_ok=True)
            return None
        if _same_file(fd, path):
            return fd
        os.close(fd)  # its holder released and removed it as we opened it: take the file there now


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
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder_line(what).encode(), 0)
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
        if _same_file(fd, lock_path(target)):
            lock_path(target).unlink(missing_ok=True)
        os.close(fd)


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


def probe(path: Path) -> str | None:
    """The line of the process holding the flock of ``path`` (a lock file: this module's, or a run's lock), or
    None when nobody holds it, there is no such file or the file system has no locks. Takes a shared lock for a
    moment."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read(fd) or "holder unknown"
    except OSError:  # ENOLCK / EOPNOTSUPP: nothing to learn on a file system without locks
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holder_line(what: str = "") -> str:
    """What a lock file says of its holder: ``what``, this pid, host and time."""
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"{what + ', ' if what else ''}pid {os.getpid()} on {socket.gethostname()} since {since}\n"
