"""Directories written to survive a kill or a node crash: checkpoints, ``final/`` and exports.

- Synced: a file's bytes (and a directory's entries) reach the disk before a marker or a rename says they are
  complete. Without it a node crash can leave a checkpoint marked COMPLETE whose shards were still in the page
  cache, truncated on disk.
- Replaced, not deleted then written: the old directory is renamed aside, the new one renamed in, then the old
  one is removed, so a kill at any moment leaves a whole old or new one (aside, under a name only we use, the
  next writer puts it back when nothing took its place).
- Our own temporary names, beside the target: ``.NAME.coati-kto-<kind>-<8 hex>``, created exclusively. A fixed
  name like ``NAME.tmp`` or ``NAME.prepared`` may be a user's folder, which ``rmtree`` must never take for ours.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

_TAG = "coati-kto"
NEW, OLD, DATA = (
    "new",
    "old",
    "data",
)  # a directory being written, one replaced (aside), an export's scratch data
_LEFTOVER = re.compile(rf"\.(?P<name>.+)\.{_TAG}-(?P<kind>{NEW}|{OLD})-[0-9a-f]{{8}}")


def own_dir(target: Path, kind: str) -> Path:
    """A new empty directory beside ``target``, named for it and ``kind`` (NEW, OLD, DATA) and ours alone:
    created exclusively (mkdir fails on any existing name), with the default permissions (mkdtemp's 0700 would
    end up on final/)."""
    while True:
        path = target.parent / f".{target.name}.{_TAG}-{kind}-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
            return path
        except FileExistsError:  # 1 in 4 billion: draw another name
            continue


def sync_file(path: Path) -> None:
    """``path``'s bytes on disk (fsync). Raises OSError when the disk reports a failed write (EIO, ENOSPC)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """``path``'s entries (new names, renames) on disk. A filesystem that cannot sync a directory (some FUSE and
    network mounts answer EINVAL) syncs it on its own terms: not an error."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def sync_files(root: Path, keep: Callable[[Path], bool] = lambda path: True) -> int:
    """Every regular file under ``root`` that ``keep`` accepts, synced; returns how many."""
    count = 0
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            if not keep(path) or path.is_symlink():
                continue
            try:
                sync_file(path)
            except FileNotFoundError:  # another rank's scratch file, gone since the listing: not ours
                continue
            count += 1
    return count


def sync_dirs(root: Path) -> None:
    """``root`` and every directory under it: their entries on disk (deepest first, ``root`` last)."""
    for folder, _, _ in sorted(os.walk(root), key=lambda entry: -len(Path(entry[0]).parts)):
        sync_dir(Path(folder))


def write_synced(path: Path, text: str) -> None:
    """``text`` as ``path``, on disk before this returns."""
    with open(path, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())


def replace_dir(new: Path, target: Path) -> None:
    """The complete directory ``new`` at ``target`` (same filesystem): an existing ``target`` is renamed aside,
    ``new`` renamed in, the parent's entries synced, then the old one removed (left for :func:`recover` when it
    cannot be: never a failure, ``target`` is complete)."""
    aside = None
    if target.exists():
        aside = own_dir(target, OLD)
        os.replace(target, aside)  # onto our empty directory: rename(2) replaces an empty one
    try:
        os.replace(new, target)
    except OSError:
        if aside is not None:  # the old one back where it was: the caller reports the failure
            os.replace(aside, target)
        raise
    sync_dir(target.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def recover(parent: Path, name: str | None = None) -> None:
    """Leftovers of a :func:`replace_dir` or :func:`write_dir` under ``parent`` that a kill interrupted (of
    target ``name`` only, or of any): an old copy renamed aside goes back when nothing took its place, anything
    else of ours is removed. Only names :func:`own_dir` gives (``.NAME.coati-kto-new-`` or ``-old-`` and 8 hex
    digits) are touched; an export's scratch data (``-data-``) is its own command's to remove."""
    if not parent.is_dir():
        return
    for leftover in sorted(parent.iterdir()):
        match = _LEFTOVER.fullmatch(leftover.name)
        if match is None or not leftover.is_dir() or (name is not None and match["name"] != name):
            continue
        target = parent / match["name"]
        if match["kind"] == OLD and not target.exists():
            os.replace(leftover, target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def write_dir(target: Path, write: Callable[[Path], None]) -> None:
    """``write(directory)`` into a new directory of ours beside ``target``, synced, then put at ``target`` by
    :func:`replace_dir`: ``target`` is whole (old or new) or absent at every moment. A failed ``write`` removes
    the partial directory and raises; an earlier kill's leftovers of ``target`` are recovered first."""
    recover(target.parent, target.name)
    new = own_dir(target, NEW)
    try:
        write(new)
        sync_files(new)
        sync_dirs(new)
        replace_dir(new, target)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
