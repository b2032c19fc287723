"""What every lock file of coati-kto shares: the line naming its holder, taking a lock, and the probe that reads it.

The locks are ``flock`` locks on files beside what they guard: the run lock (``runtime.run_dir``), one writer per
export target (``runtime.target_lock``) and the readers of a prepared build (``data.prepared_lock``). The kernel
drops them when their process dies, however it dies, and whatever its host (NFS keeps such locks on its server).
A file system that refuses ``flock`` (ENOLCK, EOPNOTSUPP: some FUSE mounts) gets no lock, and no lock file either.
Here, on the lowest floor, so that the data package and the runtime read one definition of each.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path


def holder_line(what: str = "") -> str:
    """What a lock file says of its holder: ``what``, this pid, host and time."""
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    return f"{what + ', ' if what else ''}pid {os.getpid()} on {socket.gethostname()} since {since}\n"


def read_line(fd: int) -> str:
    """The holder's line in the lock file open as ``fd`` ('' when it holds none or cannot be read)."""
    with contextlib.suppress(OSError):
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    return ""


def same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file ``fd`` has open (a holder removes its lock file on release)."""
    try:
        now, mine = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino)


def locked(path: Path) -> int | None:
    """A descriptor of ``path`` (made when missing) holding its exclusive flock, taken without waiting; None where
    the file system refuses flock (the file made for it removed). Raises BlockingIOError holding the holder's line
    while another process holds it, OSError when the file cannot be made. A file its holder removed as this opened
    it is not taken: the one at ``path`` now is."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_line(fd)
            os.close(fd)
            raise BlockingIOError(holder or "holder unknown") from None
        except OSError:  # ENOLCK / EOPNOTSUPP: no locks here, and no lock file left behind either
            os.close(fd)
            path.unlink(missing_ok=True)
            return None
        if same_file(fd, path):
            return fd
        os.close(fd)


def write_holder(fd: int, what: str = "") -> None:
    """``fd``'s lock file says this process holds it (:func:`holder_line`), over whatever an earlier holder wrote."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder_line(what).encode(), 0)


def remove_and_unlock(fd: int, path: Path) -> None:
    """Let go of the lock ``fd`` holds on ``path``: the file removed first, while still held (a process that opened
    it meanwhile sees it gone and takes a new one, :func:`locked`), unless another file has taken its name."""
    if same_file(fd, path):
        path.unlink(missing_ok=True)
    os.close(fd)


def probe(path: Path) -> str | None:
    """The line of the process holding the flock of ``path`` (a lock file of coati-kto's), or None when nobody
    holds it, there is no such file or the file system has no locks. Takes a shared lock for a moment."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_line(fd) or "holder unknown"
    except OSError:  # ENOLCK / EOPNOTSUPP: nothing to learn on a file system without locks
        return None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
