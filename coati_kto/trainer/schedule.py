"""The learning-rate schedule: linear warmup that starts above 0, then a cosine or linear decay to ``min_lr_ratio``.

transformers' cosine-with-warmup schedules give lr 0 to the first optimizer step (factor step / warmup at
step 0), so the first update is wasted. Here optimizer step k (1-based) of the warmup uses
``lr * k / (warmup_steps + 1)``; step ``warmup_steps + 1`` uses the full lr, and the decay (``train.lr_schedule``)
runs from there toward ``min_lr_ratio * lr``, which it reaches after the last step of ``total_steps`` (as
transformers' cosine and linear schedules: the last step's lr is one decay step above it).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from coati_kto.config.schema import TrainSection


def lr_factor(
    scheduler_step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float, decay: str = "cosine"
) -> float:
    """The lr multiplier for the optimizer step taken after ``scheduler_step`` scheduler steps (0-based);
    ``decay``: ``cosine`` or ``linear`` (``train.lr_schedule``)."""
    if scheduler_step < warmup_steps:
        return (scheduler_step + 1) / (warmup_steps + 1)
    progress = min(1.0, (scheduler_step - warmup_steps) / max(1, total_steps - warmup_steps))
    left = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * left


def planned_steps(
    micro_batches_per_rank: int,
    accumulation_steps: int,
    max_epochs: int,
    max_steps: int | None,
    resumed: tuple[int, int, int] | None = None,
) -> int:
    """Optimizer steps of the run, capped by ``max_steps``: epochs x ceil(micro-batches / accumulation).

    ``resumed`` (global step, epoch, micro-batches this rank has left of that epoch): the steps done, the rest of
    the epoch in progress (re-planned when the layout or micro-batch size changed), then whole epochs. With an
    unchanged config this is the fresh count. The LR schedule spans exactly this many steps: a max_steps beyond
    them must not stretch the cosine over steps that never run.
    """
    per_epoch = math.ceil(micro_batches_per_rank / accumulation_steps)
    total = per_epoch * max_epochs
    if resumed is not None:
        step, epoch, left = resumed
        total = step + math.ceil(left / accumulation_steps) + per_epoch * max(0, max_epochs - epoch - 1)
    return min(max_steps, total) if max_steps else total


def warmup_decay_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    decay: str = "cosine",
) -> LambdaLR:
    """A LambdaLR of :func:`lr_factor` (one per parameter group, all the same); step it once per optimizer step
    that updates or is skipped as non-finite (not on a step the fp16 loss scaler skips)."""
    return LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, min_lr_ratio, decay))


def rebase_lr(scheduler: LambdaLR, lr: float) -> None:
    """Make ``lr`` the schedule's peak from the current step on (a resume with a changed ``train.lr``).

    A restored LambdaLR keeps the ``base_lrs`` of the run that saved it, so a new ``train.lr`` would be ignored
    while config.yaml and the model card recorded it. Every rank calls it after loading the scheduler's state.
    """
    scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
    for group, lr_lambda in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * lr_lambda(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def reschedule(
    scheduler: LambdaLR,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float,
    decay: str = "cosine",
) -> None:
    """After a resume: the schedule of this run's ``total_steps`` with peak ``lr`` from the current step on
    (the restored state keeps the step count; the old run may have had another length, peak or decay). Every
    rank."""
    scheduler.lr_lambdas = [
        lambda s: lr_factor(s, warmup_steps, total_steps, min_lr_ratio, decay) for _ in scheduler.lr_lambdas
    ]
    rebase_lr(scheduler, lr)


def accumulation_note(train: TrainSection, micro_batches: int, dp_size: int) -> str | None:
    """The line for train.accumulation_steps longer than an epoch's ``micro_batches`` per data-parallel rank (over
    ``dp_size`` ranks): every optimizer step then holds one epoch. None otherwise."""
    m, a = train.micro_batch_size, train.accumulation_steps
    if a <= micro_batches:
        return None
    return (
        f"train.accumulation_steps {a} is more than the {micro_batches} micro-batches each data-parallel rank has "
        f"per epoch: each optimizer step holds one epoch, {micro_batches * m * dp_size} examples, not the "
        f"{a * m * dp_size} the batch settings multiply to"
    )


def schedule_notes(train: TrainSection, steps: int, micro_batches: int, dp_size: int) -> list[str]:
    """One line each for a schedule of ``steps`` optimizer steps that will not run as the ``train`` section
    reads. ``micro_batches``: each data-parallel rank's per epoch, over ``dp_size`` ranks."""
    notes: list[str] = []
    if (accumulation := accumulation_note(train, micro_batches, dp_size)) is not None:
        notes.append(f"note: {accumulation}")
    if train.max_steps and steps < train.max_steps:
        notes.append(
            f"note: train.max_epochs {train.max_epochs} holds {steps} optimizer steps, fewer than "
            f"train.max_steps {train.max_steps}: the run ends after {steps}"
        )
    if train.warmup_steps >= steps:
        notes.append(
            f"warning: train.warmup_steps {train.warmup_steps} is not shorter than the run ({steps} optimizer "
            f"steps): the learning rate never reaches train.lr {train.lr} (peak {train.lr * steps / (train.warmup_steps + 1):.3g})"
        )
    return notes


def current_lr(optimizer: torch.optim.Optimizer, lr_scheduler: Any | None) -> float:
    """The learning rate of the step about to be taken: the schedule's, else the optimizer's first group's."""
    if lr_scheduler is not None:
        return float(lr_scheduler.get_last_lr()[0])
    return float(optimizer.param_groups[0]["lr"])
