"""Who uses a build of ``data.prepared_dir``: a build that would replace one another process reads is refused.

A build replaces ``data.prepared_dir`` whole, by rename (:mod:`coati_kto.data.store`). A run or ``prepare`` of other
data settings on the same directory replaced the build a run was training on without a word: that run went on
from its deleted files, but its reference cache (hours of scoring) went with the folder, and its resume later
rebuilt its own data in place, replacing the other run's in turn.

Two kinds of lock file beside the directory (``flock``, through :mod:`coati_kto.locks`):

- ``.NAME.coati-kto.lock``: one process at a time decides whether to reuse the build or make one, and makes it
  (:func:`deciding`). Another waits for it (saying so once), then finds its build: runs of one data setting
  started together build once.
- ``.NAME.coati-kto.PID-XXXXXXXX.reader``: held by each process that uses the build, from its decision until its
  command ends (:func:`read_from_now`, :func:`release`), naming it. A build while another process holds one is
  refused in one line naming that process (:func:`refuse_if_read`); reuse of the same build needs no more.

Readers register only while deciding, so the process deciding sees every one, and removes a killed one's file. A
run's global rank 0 (the rank that builds) holds them for the run. A file system without ``flock``, or a folder this
process cannot write (a read-only data set), is used unlocked, as before.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from coati_kto.errors import DataError
from coati_kto.locks import locked, probe, remove_and_unlock, write_holder

_WAIT_S = 0.2  # how often a process waiting for another's decision (a build: minutes) looks again
_DECIDING: set[Path] = set()  # targets this process is deciding (nested: the lock is not taken twice)
_READING: dict[Path, tuple[int, Path, int]] = {}  # target -> (its reader file's descriptor, the file, holds)


def lock_path(target: Path) -> Path:
    """The decision lock of ``target``: beside it, a name no build or user folder has."""
    return target.parent / f".{target.name}.coati-kto.lock"


def _key(target: Path) -> Path:
    return target.parent.resolve() / target.name


def _command() -> str:
    """This process's command line, for the holder's line (``coati-kto train run.yaml data.max_length=512``)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    name = {"__main__.py": "python -m coati_kto", "-c": "python -c"}.get(name, name)
    line = " ".join([name, *sys.argv[1:]])
    return line if len(line) <= 160 else line[:157] + "..."


def _take(target: Path) -> int | None:
    """The decision lock of ``target``, waited for while another process holds it; None where there are no locks
    (a file system without flock, a folder this process cannot write: a build there fails with its own line)."""
    said = False
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = locked(lock_path(target))
        except BlockingIOError as err:
            if not said:
                print(
                    f"data.prepared_dir {target}: waiting for another process preparing it ({err})",
                    flush=True,
                )
                said = True
            time.sleep(_WAIT_S)
            continue
        except OSError:
            return None
        if fd is not None:
            write_holder(fd, _command())
        return fd


@contextlib.contextmanager
def deciding(target: Path) -> Iterator[None]:
    """``target``'s decision lock held for the block: one process at a time reuses or builds it."""
    key = _key(target)
    if key in _DECIDING:
        yield
        return
    fd = _take(target)
    _DECIDING.add(key)
    try:
        yield
    finally:
        _DECIDING.discard(key)
        if fd is not None:
            remove_and_unlock(fd, lock_path(target))


def _live_readers(target: Path) -> list[str]:
    """The lines of the other processes reading ``target``'s build; the files of readers gone are removed (while
    deciding: nobody registers meanwhile)."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.coati-kto\.\d+-[0-9a-f]{{8}}\.reader")
    mine = _READING[_key(target)][1].name if _key(target) in _READING else None
    live = []
    if not target.parent.is_dir():
        return live
    for path in sorted(target.parent.glob(f".{target.name}.coati-kto.*.reader")):
        if path.name == mine or not pattern.fullmatch(path.name):
            continue
        line = probe(path)
        if line is None:  # its process is gone (killed): the kernel dropped its lock
            path.unlink(missing_ok=True)
        else:
            live.append(line)
    return live


def read_from_now(target: Path) -> None:
    """While deciding: this process uses ``target``'s build until :func:`release` (nested calls count)."""
    key = _key(target)
    if key in _READING:
        fd, path, holds = _READING[key]
        _READING[key] = (fd, path, holds + 1)
        return
    _live_readers(target)  # a killed run's file goes here too, not only at the next build
    path = target.parent / f".{target.name}.coati-kto.{os.getpid()}-{uuid.uuid4().hex[:8]}.reader"
    try:
        fd = locked(path)
    except OSError:  # cannot write beside it: nobody builds there from here either
        return
    if fd is not None:
        write_holder(fd, _command())
        _READING[key] = (fd, path, 1)


def release(target: Path) -> None:
    """The end of one :func:`read_from_now` of ``target`` (nothing when this process holds none); the last removes
    this process's reader file."""
    key = _key(target)
    if key not in _READING:
        return
    fd, path, holds = _READING.pop(key)
    if holds > 1:
        _READING[key] = (fd, path, holds - 1)
        return
    remove_and_unlock(fd, path)


def release_all() -> None:
    """Every build this process uses released at once (its reader files removed): a pooled test worker between
    tasks, whose task called ``load_prepared`` without its command's release (a fresh process's exit did that)."""
    for key in list(_READING):
        fd, path, _ = _READING.pop(key)
        remove_and_unlock(fd, path)


def refuse_if_read(target: Path, why: str) -> None:
    """While deciding, before a build of ``target`` (``why``: its reason, ``changed: data.max_length``): raises
    DataError naming the other processes that use the build there, which the build would replace under them."""
    live = _live_readers(target)
    if not live:
        return
    who = "another process uses" if len(live) == 1 else f"{len(live)} other processes use"
    raise DataError(
        f"data.prepared_dir {target}: {who} the build there ({'; '.join(live)}); building these data settings "
        f"({why}) would replace it under {'it' if len(live) == 1 else 'them'}: give these settings their own "
        "data.prepared_dir, or run this once it has ended"
    )
