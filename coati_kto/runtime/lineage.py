"""Which checkpoint under ``output.dir/checkpoints`` a resume takes, and which ones are a run's own.

Each save's ``meta.json`` names its ``id`` and ``previous``: the id the run it belongs to gave the checkpoint it
saved or resumed from before. A run resumed by hand from an earlier step starts a new lineage (a fork): the
checkpoint manager writes ``fork.json`` beside ``latest`` (the checkpoint resumed from, its id, and a fresh
id for the fork) and moves ``latest`` to that checkpoint; the run's first save names the fork's id as
``previous`` and keeps the fork in its own meta.json. The abandoned run's later saves name the checkpoint's own
id, so they are never taken for this run's, before or after its first save.

``resolve_checkpoint`` reads names and markers only (any process, any time); ``resume_choice`` also checks the
checkpoint it is about to hand to a load (``checkpoint_check.damage``) and, for ``auto``, falls back along the
lineage past a damaged one. Filesystem reads only: no collectives.
"""

from __future__ import annotations

import json
from pathlib import Path

from coati_kto.errors import UserError
from coati_kto.runtime.checkpoint_check import damage
from coati_kto.runtime.run_dir import (
    COMPLETE,
    FORK,
    LATEST,
    checkpoint_meta,
    checkpoint_step,
    complete_checkpoints,
)


def _pointer_name(root: Path) -> str | None:
    """The step the ``latest`` pointer names; None when it is missing or unreadable (not text: a damaged disk)."""
    try:
        return (root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_fork(root: Path) -> dict:
    """``root/fork.json``: ``checkpoint`` (the step-N resumed from by hand), ``from`` (its id) and ``id`` (the
    fork's); {} when there is none or it is unreadable."""
    try:
        fork = json.loads((root / FORK).read_text())
    except (OSError, ValueError):
        return {}
    return fork if isinstance(fork, dict) else {}


def fork_at(root: Path, checkpoint: Path) -> dict | None:
    """The fork a hand resume started at ``checkpoint``, while it is the run's newest (``latest`` names it, and
    it is the very checkpoint resumed from: a later save over the same step has another id); else None."""
    fork = read_fork(root)
    if (
        not fork.get("id")
        or fork.get("checkpoint") != checkpoint.name
        or _pointer_name(root) != checkpoint.name
    ):
        return None
    return fork if fork.get("from") == checkpoint_meta(checkpoint).get("id") else None


def lineage_id(root: Path, checkpoint: Path) -> str | None:
    """The id the next save of a run standing at ``checkpoint`` names as ``previous``: the fork's when a hand
    resume started one there, else the checkpoint's own (None for one saved before ids were kept)."""
    fork = fork_at(root, checkpoint)
    return fork["id"] if fork else checkpoint_meta(checkpoint).get("id")


def _newest_after(root: Path, named: Path, pointer_written: int) -> Path:
    """The pointer's checkpoint ``named``, or the last of its run's saves after it that the pointer missed (a save
    killed between its rename into step-N and the pointer's update; a pointer that could not be written): the
    saves that name its lineage id (:func:`lineage_id`) as ``previous``, then those that name them. Neither a copy
    (cp -r, hf download, a sync: new file times in any order), nor an abandoned run's saves after a hand resume
    (they name the checkpoint's own id, not the fork's) name it. A checkpoint written before ids were kept
    (2026-12-01) counts when it completed after the pointer was written."""
    current, here = named, lineage_id(root, named)
    later = [p for p in complete_checkpoints(root) if checkpoint_step(p) > checkpoint_step(named)]
    while True:
        following = [
            p
            for p in later
            if checkpoint_step(p) > checkpoint_step(current) and _follows(p, here, pointer_written)
        ]
        if not following:
            return current
        current = max(following, key=checkpoint_step)
        here = checkpoint_meta(current).get("id")


def _follows(checkpoint: Path, previous_id: str | None, pointer_written: int) -> bool:
    """Whether ``checkpoint`` is a save of the run whose previous checkpoint has ``previous_id``."""
    meta = checkpoint_meta(checkpoint)
    if "previous" in meta:
        return previous_id is not None and meta["previous"] == previous_id
    return (checkpoint / COMPLETE).stat().st_mtime_ns > pointer_written  # written before ids were kept


def resolve_checkpoint(root: Path, resume: str | None) -> Path | None:
    """``train.resume`` resolved against ``root``: None -> None; 'auto' -> the newest complete checkpoint of the
    current lineage, or None; a path -> that checkpoint. Raises UserError (one line) for a path that is missing
    or incomplete. Names and markers only: see :func:`resume_choice` for the checkpoint a load reads."""
    if resume is None:
        return None
    if resume == "auto":
        pointer, name = root / LATEST, _pointer_name(root)
        if pointer.is_file() and name:
            named = root / name
            if (named / COMPLETE).is_file():
                return _newest_after(root, named, pointer.stat().st_mtime_ns)
        complete = complete_checkpoints(root)  # pointer missing or stale: the highest complete step
        return complete[-1] if complete else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(
            f"train.resume: checkpoint {path} does not exist (train.resume=auto picks the latest one)"
        )
    if not (path / COMPLETE).is_file():
        raise UserError(
            f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker: its save was interrupted, "
            "or it is not a step-N directory); use train.resume=auto or another step-N"
        )
    return path


def predecessor(root: Path, checkpoint: Path) -> Path | None:
    """The complete checkpoint under ``root`` that ``checkpoint``'s run saved or resumed from before it: the one
    its ``previous`` names (through its fork, after a hand resume), or for a checkpoint without one (saved before
    ids were kept, or the first save after resuming such a one) the highest lower step. None when that one is
    gone (pruned) or there is none."""
    meta = checkpoint_meta(checkpoint)
    lower = [p for p in complete_checkpoints(root) if checkpoint_step(p) < checkpoint_step(checkpoint)]
    previous = meta.get("previous")
    if previous is None:
        return lower[-1] if lower else None
    forks = [
        f for f in (meta.get("fork"), read_fork(root)) if isinstance(f, dict) and f.get("id") == previous
    ]
    for p in reversed(lower):
        here = checkpoint_meta(p).get("id")
        if here is not None and here == previous:
            return p
        if any(p.name == f.get("checkpoint") and here == f.get("from") for f in forks):
            return p
    return None


def lineage(root: Path, newest: Path, count: int) -> list[Path]:
    """``newest`` and up to ``count - 1`` checkpoints before it in its run (:func:`predecessor`), newest first."""
    chain = [newest]
    while len(chain) < count:
        before = predecessor(root, chain[-1])
        if before is None or before in chain:
            return chain
        chain.append(before)
    return chain


def resume_choice(
    root: Path, resume: str | None, key: str = "train.resume"
) -> tuple[Path | None, str | None]:
    """The checkpoint a resume (or ``coati-kto export``, ``key`` its option) loads, checked for damage, and a
    ``warning:`` line when ``auto`` passed over damaged ones (None otherwise).

    A damaged checkpoint named by path is refused in one line (UserError) naming the intact one before it in its
    run; ``auto`` falls back to that one instead, and refuses only when none is left."""
    path = resolve_checkpoint(root, resume)
    if path is None:
        return None, None
    why = damage(path)
    if why is None:
        return path, None
    home = path.parent  # a path may name another run directory's checkpoint: the one before it is there
    earlier, passed = predecessor(home, path), [f"{path.name} ({why})"]
    while earlier is not None and (earlier_why := damage(earlier)) is not None:
        passed.append(f"{earlier.name} ({earlier_why})")
        earlier = predecessor(home, earlier)
    broken = f"checkpoint {path} is marked complete but damaged: {why}"
    sep = " " if " -" in key else "="  # an option (coati-kto export --checkpoint DIR) or a setting
    if resume != "auto":
        instead = f"the one before it is intact: {key}{sep}{earlier}" if earlier else _NONE_LEFT
        raise UserError(f"{key}: {broken}; {instead}")
    if earlier is None:
        raise UserError(f"{key}{sep}auto: {broken}; {_NONE_LEFT}")
    return earlier, (
        f"warning: {key}{sep}auto: passed over damaged checkpoint(s) {', '.join(passed)}: using "
        f"{earlier.name}, the intact one before them in this run"
    )


_NONE_LEFT = "no earlier checkpoint of its run is intact (start over with output.overwrite=true, or use another output.dir)"
