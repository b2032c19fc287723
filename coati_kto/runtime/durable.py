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

import contextlib
import errno
import os
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

from coati_kto.runtime.signals import STOP
from coati_kto.runtime.target_lock import held, holder

_TAG = "coati-kto"
NEW, OLD, DATA, GONE = (
    "new",
    "old",
    "data",
    "gone",
)  # a directory being written, one replaced (aside), an export's scratch data, one being deleted
# own_dir's names, ``.NAME.coati-kto-<kind>-<8 hex>``, of the kinds given
_OWN = r"\.(?P<name>.+)\.{tag}-(?P<kind>{kinds})-[0-9a-f]{{8}}"
_LEFTOVER = re.compile(_OWN.format(tag=_TAG, kinds=f"{NEW}|{OLD}|{GONE}"))
_ANY_OWN = re.compile(_OWN.format(tag=_TAG, kinds=f"{NEW}|{OLD}|{DATA}|{GONE}"))


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


def own_names(parent: Path, name: str) -> list[Path]:
    """Everything of ours beside ``parent / name``: the names :func:`own_dir` gives for target ``name``, of any
    kind (a write's new or old copy, an export's scratch data, a file :func:`write_file` was writing). Only
    those exact names: a user's ``.final.tmp`` or ``.final.coati-kto-old-mine`` is not ours."""
    if not parent.is_dir():
        return []
    return sorted(
        p for p in parent.iterdir() if (m := _ANY_OWN.fullmatch(p.name)) is not None and m["name"] == name
    )


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
    """Every regular file under ``root`` that ``keep`` accepts, synced, with the permissions the umask gives a new
    file where it was written 0600; returns how many."""
    count, usual = 0, 0o666 & ~_umask()
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder) / name
            if not keep(path) or path.is_symlink():
                continue
            try:
                _widen(path, usual)
                sync_file(path)
            except FileNotFoundError:  # another rank's scratch file, gone since the listing: not ours
                continue
            count += 1
    return count


def _umask() -> int:
    """This process's umask, read without setting it where /proc tells (os.umask sets it, for every thread)."""
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _widen(path: Path, usual: int) -> None:
    """safetensors writes its files 0600 (a temporary file renamed): every model.safetensors of final/, exports and
    checkpoints was unreadable to the group and others that the umask lets read the config beside it."""
    if path.stat().st_mode & 0o777 == 0o600 and usual != 0o600:
        with contextlib.suppress(OSError):  # a filesystem without modes (some FUSE mounts): left as written
            os.chmod(path, usual)


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


def write_file(path: Path, text: str) -> None:
    """``text`` as ``path``, on disk before this returns, and the old file or the whole new one at every moment:
    written synced under a name of ours beside it, renamed in, then the directory's entries synced."""
    tmp = path.parent / f".{path.name}.{_TAG}-{NEW}-{uuid.uuid4().hex[:8]}"
    try:
        write_synced(tmp, text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def replace_dir(new: Path, target: Path, background: bool = False) -> threading.Thread | None:
    """The complete directory ``new`` at ``target`` (same filesystem): an existing ``target`` is renamed aside,
    ``new`` renamed in, the parent's entries synced, then the old one removed (left for :func:`recover` when it
    cannot be: never a failure, ``target`` is complete). ``background``: removed as
    :func:`remove_in_background` does (a checkpoint saved again inside a save's agreements); its thread."""
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
    if aside is None:
        return None
    if background:
        return _remove_on_thread(aside, target, f"the old copy of {target}")
    shutil.rmtree(aside, ignore_errors=True)
    return None


# The directories this process's threads are deleting: recover() leaves them to their thread.
_REMOVING: set[Path] = set()
_REMOVING_LOCK = threading.Lock()


def remove_in_background(directory: Path) -> threading.Thread:
    """Rename ``directory`` to a name of ours (:data:`GONE`: at once, its name is free) and delete it on a thread
    of its own: deleting a checkpoint of a large model takes minutes on a network filesystem, which a rank must
    not spend while its peers wait in a collective. The interpreter waits for the thread at exit; what a kill
    leaves, :func:`recover` removes. A failure to delete is a warning naming what is left."""
    return _remove_on_thread(directory, directory, str(directory))


def _remove_on_thread(directory: Path, target: Path, shown: str) -> threading.Thread:
    """``directory`` renamed to a :data:`GONE` name of ``target``'s and deleted on a thread named ``remove
    TARGET-NAME``; ``shown`` in the warning a failed delete prints."""
    gone = own_dir(target, GONE)
    os.replace(directory, gone)  # onto our empty directory: rename(2) replaces an empty one
    with _REMOVING_LOCK:
        _REMOVING.add(gone.resolve())

    def remove() -> None:
        try:
            shutil.rmtree(gone)
        except OSError as err:
            why = f"{err.strerror}: {err.filename}" if err.strerror and err.filename else str(err)
            print(
                f"warning: could not remove {shown}, now {gone} ({why}); remove it by hand", file=sys.stderr
            )
        finally:
            with _REMOVING_LOCK:
                _REMOVING.discard(gone.resolve())

    thread = threading.Thread(target=remove, name=f"remove {target.name}")
    thread.start()
    return thread


def recover(parent: Path, name: str | None = None) -> None:
    """Leftovers of a :func:`replace_dir` or :func:`write_dir` under ``parent`` that a kill interrupted (of
    target ``name`` only, or of any): an old copy renamed aside goes back when nothing took its place, anything
    else of ours is removed. Only names :func:`own_dir` gives (``.NAME.coati-kto-new-`` or ``-old-`` and 8 hex
    digits) are touched; an export's scratch data (``-data-``) is its own command's to remove, and a directory
    a thread of this process is deleting (:func:`remove_in_background`) its thread's, and those of a target
    another live process is writing (its lock, ``target_lock``) that process's."""
    if not parent.is_dir():
        return
    with _REMOVING_LOCK:
        removing = set(_REMOVING)
    for leftover in sorted(parent.iterdir()):
        match = _LEFTOVER.fullmatch(leftover.name)
        if match is None or not leftover.is_dir() or (name is not None and match["name"] != name):
            continue
        target = parent / match["name"]
        if leftover.resolve() in removing or holder(target) is not None:
            continue
        if match["kind"] == OLD and not target.exists():
            os.replace(leftover, target)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def write_dir(target: Path, write: Callable[[Path], None]) -> None:
    """``write(directory)`` into a new directory of ours beside ``target``, synced, then put at ``target`` by
    :func:`replace_dir`: ``target`` is whole (old or new) or absent at every moment. A failed ``write`` removes
    the partial directory and raises; an earlier kill's leftovers of ``target`` are recovered first. A stop
    signal that ends precompute or export (``STOP.quit_on_stop``) removes the partial directory too, and waits
    for the renames (the old one is never left aside). One process at a time: ``target``'s lock is held
    throughout (``target_lock``; nested in a caller's hold), and TargetBusyError raised while another holds it."""
    # Another writer's recover() would delete our directory mid-write, its rename replace ours without a word.
    with held(target, "coati-kto"):
        _write_dir(target, write)


def _write_dir(target: Path, write: Callable[[Path], None]) -> None:
    """:func:`write_dir` under ``target``'s lock."""
    recover(target.parent, target.name)
    new = None
    try:
        with STOP.held():  # made and named here at once: a stop between the two would leave it behind
            new = own_dir(target, NEW)
        write(new)
        sync_files(new)
        sync_dirs(new)
        with STOP.held():
            replace_dir(new, target)
    except BaseException:
        if new is not None:
            shutil.rmtree(new, ignore_errors=True)
        raise
