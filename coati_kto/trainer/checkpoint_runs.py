"""The main rank's bookkeeping of which run a checkpoint belongs to (coati_kto.runtime.lineage): the ids each
save's meta.json records, the fork a hand resume starts, and pruning to ``output.keep_last`` along the lineage.
Used by coati_kto.trainer.checkpoint.CheckpointManager."""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from coati_kto.runtime.durable import remove_in_background
from coati_kto.runtime.lineage import fork_at, lineage, lineage_id, resolve_checkpoint
from coati_kto.runtime.run_dir import (
    COMPLETE,
    FORK,
    LATEST,
    checkpoint_meta,
    checkpoint_step,
    complete_checkpoints,
)
from coati_kto.trainer.export import write_atomic
from coati_kto.trainer.write_failures import describe


def warn(message: str) -> None:
    """One line on stderr (the main rank's): what went wrong around a complete checkpoint."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


class RunLineage:
    """Where this run stands in ``root``'s lineages: the id its next save names as ``previous`` and, until that
    save, the fork a hand resume started (kept in the save's meta.json: how the new lineage joins the older one)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.previous: str | None = None
        self.fork: dict[str, Any] | None = None

    def next_meta(self) -> dict[str, Any]:
        """The ``id``, ``previous`` (and ``fork``) of the save being written."""
        meta: dict[str, Any] = {"id": uuid.uuid4().hex, "previous": self.previous}
        if self.fork is not None:
            meta["fork"] = self.fork
        return meta

    def saved(self, ident: str) -> None:
        """The save with ``ident`` is complete: the next one follows it."""
        self.previous, self.fork = ident, None

    def resumed_from(self, checkpoint: Path, is_main: bool) -> None:
        """After loading ``checkpoint``. The one resume=auto picks continues its run. Any other of this directory
        (a hand resume from an earlier step, or past a damaged newer one) starts a fork: ``fork.json`` names the
        checkpoint and a fresh id, then the pointer moves to the checkpoint, so that resume=auto after a crash
        takes this run's saves, never the abandoned run's later ones (which name the checkpoint's own id). A kill
        between the two writes leaves the pointer where it was and the fork unused: nothing was trained on it."""
        self.previous, self.fork = None, None
        if not is_main or checkpoint.parent.resolve() != self.root.resolve():
            return  # only the main rank writes meta.json; another directory's checkpoint starts this one's run
        auto = resolve_checkpoint(self.root, "auto")
        here = lineage_id(self.root, checkpoint)
        if auto is not None and auto.resolve() == checkpoint.resolve() and here is not None:
            self.previous, self.fork = here, fork_at(self.root, checkpoint)
            return
        fork = {"checkpoint": checkpoint.name, "from": checkpoint_meta(checkpoint).get("id")}
        fork["id"] = uuid.uuid4().hex
        write_atomic(self.root / FORK, json.dumps(fork))
        write_atomic(self.root / LATEST, checkpoint.name)
        self.previous, self.fork = fork["id"], fork


# How long a save waits for the checkpoints it prunes to be deleted (well under train.dist_timeout).
PRUNE_WAIT_S = 10.0


def prune(root: Path, keep: Path, keep_last: int) -> None:
    """Keep ``keep`` (just saved) and the ``keep_last - 1`` checkpoints before it in its run (its lineage). Lower
    steps of another lineage (a run abandoned by a hand resume) go; higher ones are left alone and not counted,
    until this run saves over them. A lineage that ends early (a link removed by hand) is filled with the highest
    lower steps, as before lineages were kept. A checkpoint that cannot be removed is a warning."""
    step = checkpoint_step(keep)
    lower = [p for p in complete_checkpoints(root) if checkpoint_step(p) < step]
    kept = set(lineage(root, keep, keep_last))
    kept |= set([p for p in reversed(lower) if p not in kept][: max(keep_last - len(kept), 0)])
    removals = []
    for old in [p for p in lower if p not in kept]:
        try:
            (old / COMPLETE).unlink(missing_ok=True)  # first: a delete stopped partway leaves no husk
            removals.append(remove_in_background(old))
        except OSError as err:
            warn(f"could not remove the old checkpoint {old} ({describe(err)}); remove it by hand")
    # The main rank prunes between two agreements of a save while its peers wait in a collective: a delete that
    # takes longer than this (a large model on a network filesystem) finishes in the background.
    deadline = time.monotonic() + PRUNE_WAIT_S
    for removal in removals:
        removal.join(timeout=max(deadline - time.monotonic(), 0))
