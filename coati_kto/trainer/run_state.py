"""What a checkpoint records of a KTOTrainer's run, and putting it back: the step and epoch, the data position,
the skipped-step count, the logging interval open at the save, the last evaluated step, what TensorBoard got at
the step, the config and the contents' digests (``coati_kto.config.resume`` checks them). The weights, optimizer,
scheduler and RNG states are the CheckpointManager's. Every rank, its own (``trainer_state/rank-R.pt``)."""

from __future__ import annotations

import os
from typing import Any


def run_state(trainer: Any, epoch: int) -> dict[str, Any]:
    """``trainer``'s state after its step ``trainer.global_step`` of ``epoch``, for its checkpoint."""
    return {
        **trainer.position.state(trainer._train_loader, epoch),
        "dp_rank": trainer.layout.dp_rank,  # a resume on another layout reads every dp rank's position
        "global_step": trainer.global_step,
        "skipped_steps": trainer.skipped_steps,
        # the interval's steps so far: the resumed run logs its record as the whole run would have
        "interval": trainer._interval.state(),
        "last_eval_step": trainer._last_eval_step,
        # TensorBoard's writes at this step (the main rank's): a resume purges from here and writes them again
        "tensorboard_at_step": trainer._writer.written_at(trainer.global_step) if trainer._writer else [],
        "config": trainer.run_config,
        # what its relative paths were read from: a resume or export from elsewhere compares what they named
        "config_cwd": os.getcwd(),
        # biases and norm weights apart or not: at weight decay 0 the config cannot tell (config.resume)
        "optimizer_groups": len(trainer.optimizer.param_groups),
        **{
            k: (trainer.data_stats or {}).get(k)
            for k in ("train_data", "train_data_parts", "reference_weights")
        },
    }


def restore_run_state(trainer: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`run_state` recorded (older checkpoints lack some keys: their defaults)."""
    trainer.global_step = int(state["global_step"])
    trainer.start_epoch = int(state["epoch"])
    trainer.skipped_steps = int(state.get("skipped_steps", 0))
    saved_interval = ((state.get("config") or {}).get("train") or {}).get("log_interval")
    trainer._interval.load(state.get("interval"), saved_interval not in (None, trainer.options.log_interval))
    trainer.position.resume_from(state)
    trainer._last_saved_step = trainer.global_step
    # An evaluation at the checkpoint's step already happened (and was logged): do not repeat it.
    trainer._last_eval_step = state.get("last_eval_step")
    # None (a checkpoint from before they were kept): the resume purges after the step, keeping what is there.
    trainer._tensorboard_at_resume = state.get("tensorboard_at_step")


def log_resumed_step(trainer: Any) -> None:
    """A run's start, once its writer exists (on a resume: a TensorBoard purged from the checkpoint's step): what
    that step wrote, again, and an open logging interval whose length changed (train.log_interval) as a record of
    its own at the step, not mixed into the new length's first record."""
    trainer._writer.replay(trainer._tensorboard_at_resume or [], trainer.global_step)
    if trainer._interval.ends_now:
        trainer._log_interval()
