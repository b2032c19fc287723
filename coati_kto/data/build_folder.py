"""A build's temporary folder beside its target, held by a lock for as long as the building process lives.

``coati-kto prepare`` (and a run's rank 0) build ``data.prepared_dir`` in ``.NAME.tmp-PID-XXXXXXXX`` beside it and
rename that into place (coati_kto.data.store). A process killed mid-build (SIGKILL, the OOM killer, a lost node)
left its folder for good: a partial tokenized dataset and the datasets cache, as large as the data.

Each build now holds an exclusive ``flock`` on ``.NAME.tmp-PID-XXXXXXXX.lock`` (a sibling file, taken before the
folder is made) until it ends. The kernel drops the lock when its process dies, however it dies, and whatever
its PID namespace or host (NFS keeps such locks on its server and frees a dead client's). So the next build
beside the same target removes each folder whose lock it can take. A folder without a lock file (an older
version's) is left alone, and so is everything on a file system that refuses ``flock``.

The reference cache (coati_kto.reference.cache) writes each ``reference_cache/DIGEST`` the same way
(``build_folder(target, label)``), and sweeps its whole folder at every look-up (``remove_abandoned_in``).

A build that replaces a damaged target renames it aside first (``aside``: ``.NAME.old-XXXXXXXX``, the build
folder's own XXXXXXXX), then deletes it once the build is in place. A process killed in between left it for good;
the sweep that finds the build's lock free removes it with the build folder. One whose build still lives is left
to it, and so is one without a lock file of its build (an older version's random name, a file system without
``flock``), as build folders are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def _lock_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".lock")


def _take(lock: Path, create: bool) -> int | None:
    """An open descriptor of ``lock`` holding its exclusive flock; None when another process holds it, the file
    is gone (``create`` False) or the file system refuses. ``create``: made and locked as ``NAME.lock.new``,
    which no sweep opens, then renamed to ``lock``, so a sweep never finds it unheld."""
    made = lock.with_name(lock.name + ".new") if create else lock
    try:
        fd = os.open(made, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if create:
            os.rename(made, lock)
    except OSError:
        os.close(fd)
        if create:  # a file system without flock: no lock file left behind either
            made.unlink(missing_ok=True)
        return None
    return fd


def remove_abandoned(target: Path) -> list[str]:
    """Remove the build folders of ``target`` (and lock files) whose process is gone; their names."""
    return remove_abandoned_in(target.parent, re.escape(target.name))


def remove_abandoned_in(parent: Path, name: str = r"[^/]+") -> list[str]:
    """Remove the build folders in ``parent`` of the targets whose names match the regex ``name`` (any, by
    default: a folder only builds write into) and whose process is gone, with their lock files; their names."""
    pattern = re.compile(rf"\.(?P<target>{name})\.tmp-\d+-(?P<token>[0-9a-f]{{8}})")
    if not parent.is_dir():
        return []
    removed = []
    for lock in sorted(parent.glob(".*.tmp-*.lock")):
        folder = lock.with_name(lock.name.removesuffix(".lock"))
        if not (match := pattern.fullmatch(folder.name)) or (fd := _take(lock, create=False)) is None:
            continue  # alive (its process holds the lock), or not a name this module makes
        try:
            # the build folder, and the target it had set aside (a kill before the build deleted it)
            for left in (folder, parent / _aside_name(match["target"], match["token"])):
                if left.is_dir():
                    shutil.rmtree(left, ignore_errors=True)
                    removed.append(left.name)
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)
    return removed


def _aside_name(target: str, token: str) -> str:
    return f".{target}.old-{token}"


def aside(work: Path, target: Path) -> Path:
    """Where the build in ``work`` (a ``build_folder`` of ``target``) renames ``target`` before renaming itself
    into place; the build deletes it then. Named after ``work``, whose lock the sweep reads: removed with it once
    its process is gone, never while it lives."""
    return target.with_name(_aside_name(target.name, work.name[-8:]))


def removed_line(where: str, removed: list[str]) -> str:
    """The one line that says which abandoned build folders (and targets they had set aside) a sweep removed from
    ``where``."""
    set_aside = sum(bool(re.search(r"\.old-[0-9a-f]{8}$", name)) for name in removed)
    counts = [f"{len(removed) - set_aside} unfinished build folder(s)"] if len(removed) > set_aside else []
    counts += [f"{set_aside} set-aside old copy(ies)"] if set_aside else []
    return f"{where}: removed {' and '.join(counts)} of processes that were killed: {', '.join(removed)}"


@contextlib.contextmanager
def build_folder(target: Path, label: str = "data.prepared_dir") -> Iterator[Path]:
    """A new empty folder beside ``target``, held by this process until the block ends and then removed (the
    block renames it into place to keep it). Abandoned build folders of ``target`` go first, said in one line
    that names ``label``. Raises OSError when the folder cannot be made."""
    if removed := remove_abandoned(target):
        print(removed_line(f"{label} {target}", removed), flush=True)
    work = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = _take(_lock_of(work), create=True)  # before the folder: a folder never exists unheld
    try:
        work.mkdir()
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if fd is not None:
            _lock_of(work).unlink(missing_ok=True)
            os.close(fd)
