"""Where the run is in its data: which micro-batches of an epoch this rank has consumed, and how to continue
after a resume (same layout: the sampler is positioned; another layout: the rest of the epoch is re-planned).

One ``DataPosition`` per KTOTrainer, on every rank; its ``state`` goes into the rank's checkpoint.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

from coati_kto.errors import UserError


class DataPosition:
    """This rank's position: ``epoch`` of the running (or last) step, ``consumed`` micro-batches of it."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.epoch: int | None = None
        self.consumed = 0
        self._resume: dict[str, Any] | None = None
        # The running epoch at its start in this run: (fraction done before, consumed then, micro-batches in all).
        self._start: tuple[float, int, int] | None = None

    def epochs(self) -> float | None:
        """Epochs done, fractional (TRL's ``epoch``): the running epoch plus the fraction of its micro-batches
        consumed; a resume on another layout continues from the saved fraction over the re-planned rest. None
        before the first epoch starts or for a loader without a length."""
        if self.epoch is None or self._start is None:
            return None
        before, at, length = self._start
        return self.epoch + before + (1.0 - before) * (self.consumed - at) / max(1, length - at)

    def at_epoch_end(self) -> bool:
        """Whether the running epoch has no micro-batch left on this rank (every rank alike: the samplers give each
        the same count); False for a loader without a length."""
        return self._start is not None and self.consumed >= self._start[2]

    @property
    def resuming(self) -> bool:
        return self._resume is not None

    def resume_from(self, state: dict[str, Any]) -> None:
        """A checkpoint's trainer state (``epoch``, ``consumed``, ``sampler``; ``rank_states`` on another
        layout); applies to the first epoch run afterwards."""
        self._resume = state

    def state(self, loader: Any, epoch: int) -> dict[str, Any]:
        """What a checkpoint records of the position (this rank)."""
        sampler = getattr(loader, "batch_sampler", None)
        sampler_state = None
        if hasattr(sampler, "state_dict"):
            # The consumed count, not the sampler's own position: a DataLoader may have prefetched further.
            sampler_state = {**sampler.state_dict(), "epoch": epoch, "position": self.consumed}
        state = {"epoch": epoch, "consumed": self.consumed, "sampler": sampler_state}
        done = self.epochs()  # the epoch's fraction done: where a resume that re-plans the rest starts from
        return {**state, "epoch_progress": None if done is None else done - epoch}

    def steps(self, loader: Any, epoch: int) -> Iterator[list[Any]]:
        """This rank's micro-batches of ``epoch`` in groups of ``accumulation_steps`` (the last may be shorter).

        On resume inside the epoch the sampler is positioned after the consumed micro-batches (the remaining
        ones follow, as if never interrupted); a loader without such a sampler has the consumed prefix skipped.
        """
        self.epoch = epoch
        sampler = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        resume, self._resume = self._resume, None
        skip = consumed = 0
        if resume is not None and int(resume["epoch"]) == epoch:
            skip, consumed = _position(sampler, resume, epoch)
        else:
            resume = None
        self.consumed = consumed
        self._start = _epoch_start(loader, skip, consumed, resume)
        batches = itertools.islice(iter(loader), skip, None)
        while chunk := list(itertools.islice(batches, self.accumulation_steps)):
            yield chunk

    def left_in_epoch(self, loader: Any) -> tuple[int, int] | None:
        """For a pending resume: its epoch and the micro-batches this rank has left of it (after the re-plan of
        another layout or micro-batch size); None when not resuming. Positions a copy of the loader's sampler."""
        if self._resume is None:
            return None
        epoch, sampler = int(self._resume["epoch"]), getattr(loader, "batch_sampler", None)
        if not hasattr(sampler, "set_epoch"):
            return epoch, max(0, len(loader) - int(self._resume["consumed"]))
        sampler = copy.deepcopy(sampler)
        sampler.set_epoch(epoch)
        skip, _ = _position(sampler, self._resume, epoch)
        return epoch, max(0, len(sampler) - skip)


def _epoch_start(
    loader: Any, skip: int, consumed: int, resume: dict[str, Any] | None
) -> tuple[float, int, int] | None:
    """(fraction of the epoch done before, micro-batches consumed then, micro-batches of the epoch in all) for
    :meth:`DataPosition.epochs`, from the positioned loader (whose length counts what it still yields, plus the
    ``skip`` its iterator skips); None for a loader without a length."""
    try:
        length = len(loader) + consumed - skip
    except TypeError:
        return None
    # The saved fraction: consumed / length only holds for an epoch never re-planned (a resume on another layout
    # re-plans the rest, whose micro-batches then count for less each), and a later resume inside it must go on
    # from what the earlier one reached. Checkpoints before it was saved: the count.
    saved = (resume or {}).get("epoch_progress")
    before = float(saved) if saved is not None else consumed / max(1, length)
    return before, consumed, length


def _position(sampler: Any, resume: dict[str, Any], epoch: int) -> tuple[int, int]:
    """Position ``sampler`` for a resume inside ``epoch``: at the saved position (same layout), or over a
    re-plan of the epoch's unconsumed examples (another layout or micro-batch size). Returns the micro-batches
    the loader's iterator must still skip (a sampler that cannot be positioned) and the consumed count to keep."""
    start = int(resume["consumed"])
    saved = resume.get("sampler")
    if resume.get("rank_states") is not None:  # another layout
        _replan(sampler, resume["rank_states"], epoch)
        return 0, sampler.start
    if start and _resized(sampler, saved):
        # Same layout: every rank consumed as many micro-batches, so each old rank's state equals this one's.
        _replan(sampler, [{"sampler": saved, "consumed": start}] * sampler.num_replicas, epoch)
        return 0, sampler.start
    if start and hasattr(sampler, "load_state_dict"):
        try:
            sampler.load_state_dict({**(saved or {}), "epoch": epoch, "position": start})
        except ValueError as err:
            raise UserError(
                f"train.resume: the checkpoint's data order does not fit this run: {err}"
            ) from None
        return 0, start
    return start, start


def _replan(sampler: Any, old_ranks: list[dict[str, Any]], epoch: int) -> None:
    """Position ``sampler`` from every old data-parallel rank's saved state (a resume on another layout)."""
    if not hasattr(sampler, "load_state_dicts") or any(s.get("sampler") is None for s in old_ranks):
        raise UserError(
            "train.resume: the checkpoint was saved on another parallel layout and this data loader cannot "
            "re-plan the interrupted epoch (it needs coati_kto's MixedLabelBatchSampler in both runs)"
        )
    states = [{**s["sampler"], "epoch": epoch, "position": int(s["consumed"])} for s in old_ranks]
    try:
        sampler.load_state_dicts(states)
    except ValueError as err:
        raise UserError(f"train.resume: the checkpoint's data order does not fit this run: {err}") from None


def _resized(sampler: Any, saved: dict[str, Any] | None) -> bool:
    """Whether a same-layout resume changed the micro-batch size (the rest of the epoch is then re-planned)."""
    if saved is None or not hasattr(sampler, "load_state_dicts") or "micro_batch_size" not in saved:
        return False
    return int(saved["micro_batch_size"]) != sampler.micro_batch_size
