"""SLTrainer: the epoch loop shared by supervised-style trainers (ColossalChat's shape, our contracts).

``fit`` = ``_before_fit`` -> for each epoch from ``start_epoch``: ``_train(epoch)`` then ``_eval(epoch)``
-> ``_after_fit``; ``_cleanup`` runs even when training raises. Every rank calls ``fit`` with its own
dataloaders; subclasses own what happens inside an epoch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch.optim import Optimizer


class SLTrainer(ABC):
    """Base trainer.

    Args:
        booster: the ColossalAI Booster that boosted ``model`` and ``optimizer``.
        max_epochs: epochs to run (an epoch may end early when a subclass reaches its step limit).
        model: the boosted model being trained (the policy, for KTO).
        optimizer: the boosted optimizer.
        plugin: the booster's plugin.
        start_epoch: first epoch to run; a resume may move it (and ``global_step``) forward.
    """

    def __init__(
        self,
        booster: Any,
        max_epochs: int,
        model: Any,
        optimizer: Optimizer,
        plugin: Any,
        start_epoch: int = 0,
    ) -> None:
        if max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {max_epochs}")
        self.booster = booster
        self.max_epochs = max_epochs
        self.model = model
        self.optimizer = optimizer
        self.plugin = plugin
        self.start_epoch = start_epoch
        self.global_step = 0  # optimizer steps taken (or skipped) so far, over all epochs

    @abstractmethod
    def _before_fit(
        self, train_dataloader: Any, eval_dataloader: Any, log_dir: str | None, use_wandb: bool
    ) -> None:
        """Keep the dataloaders, open writers; called once per ``fit``."""

    @abstractmethod
    def _train(self, epoch: int) -> None:
        """Run the optimizer steps of ``epoch`` (the rest of it, when resuming inside it)."""

    @abstractmethod
    def _eval(self, epoch: int) -> None:
        """Evaluate at the end of ``epoch`` (a no-op without an eval dataloader)."""

    def _finished(self) -> bool:
        """True once a step limit is reached: no further epoch starts."""
        return False

    def _after_epoch(self, epoch: int) -> None:
        """After each epoch's training and evaluation (e.g. its last step's checkpoint)."""
        return None

    def _after_fit(self) -> None:
        """After the last epoch, on success only (e.g. the final checkpoint)."""
        return None

    def _cleanup(self) -> None:
        """Always, even after an exception (close writers, progress bars)."""
        return None

    def fit(
        self,
        train_dataloader: Any,
        eval_dataloader: Any = None,
        log_dir: str | None = None,
        use_wandb: bool = False,
    ) -> None:
        """Train from ``start_epoch`` (and the resumed step) to ``max_epochs``; every rank calls."""
        try:
            self._before_fit(train_dataloader, eval_dataloader, log_dir, use_wandb)
            for epoch in range(self.start_epoch, self.max_epochs):
                if self._finished():
                    # Resumed at the step limit (its checkpoint saved just before the end's evaluation, or a stop
                    # there): that evaluation, as the run would have had it; a no-op where it had run.
                    self._eval(epoch)
                    break
                self._train(epoch)
                self._eval(epoch)
                self._after_epoch(epoch)
            self._after_fit()
        finally:
            self._cleanup()
