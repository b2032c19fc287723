"""Where the run is in its data: which micro-batches of an epoch this rank has consumed, and how to continue
after a resume (same layout: the sampler is positioned; another layout: the rest of the epoch is re-planned).

One ``DataPosition`` per KTOTrainer, on every rank; its ``state`` goes into the rank's checkpoint.
"""

from __future__ import annotations

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
        return {"epoch": epoch, "consumed": self.consumed, "sampler": sampler_state}

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
        here = resume is not None and int(resume["epoch"]) == epoch
        start = int(resume["consumed"]) if here else 0
        if here and resume.get("rank_states") is not None:  # another layout: re-plan the rest of the epoch
            batches = self._replanned(loader, sampler, resume["rank_states"], epoch)
            start = sampler.start
        elif start and hasattr(sampler, "load_state_dict"):
            saved = resume.get("sampler") or {}
            try:
                sampler.load_state_dict({**saved, "epoch": epoch, "position": start})
            except ValueError as err:
                raise UserError(
                    f"train.resume: the checkpoint's data order does not fit this run: {err}"
                ) from None
            batches: Iterator = iter(loader)
        else:
            batches = itertools.islice(iter(loader), start, None)
        self.consumed = start
        while chunk := list(itertools.islice(batches, self.accumulation_steps)):
            yield chunk

    @staticmethod
    def _replanned(loader: Any, sampler: Any, old_ranks: list[dict[str, Any]], epoch: int) -> Iterator:
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
            raise UserError(
                f"train.resume: the checkpoint's data order does not fit this run: {err}"
            ) from None
        return iter(loader)
