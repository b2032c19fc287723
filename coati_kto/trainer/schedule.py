"""The learning-rate schedule: linear warmup that starts above 0, then cosine decay to ``min_lr_ratio``.

transformers' cosine-with-warmup schedules give lr 0 to the first optimizer step (factor step / warmup at
step 0), so the first update is wasted. Here optimizer step k (1-based) of the warmup uses
``lr * k / (warmup_steps + 1)``; step ``warmup_steps + 1`` uses the full lr, and the cosine runs from there
to ``min_lr_ratio * lr`` at the last step of ``total_steps``.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(scheduler_step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The lr multiplier for the optimizer step taken after ``scheduler_step`` scheduler steps (0-based)."""
    if scheduler_step < warmup_steps:
        return (scheduler_step + 1) / (warmup_steps + 1)
    progress = min(1.0, (scheduler_step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """A LambdaLR of :func:`lr_factor`; step it once per optimizer step (skipped steps included)."""
    return LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps, min_lr_ratio))


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
