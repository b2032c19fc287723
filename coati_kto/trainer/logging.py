"""Scalars to TensorBoard and W&B, and the progress bar: written by the main rank only.

Every rank builds a ``MetricWriter`` (so callers need no rank checks); on non-main ranks it holds no writer and
every call is a no-op. Values arrive already reduced over the data-parallel group (see trainer/metrics.py).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


class MetricWriter:
    """TensorBoard under ``tensorboard_dir`` and/or a W&B run, on the main rank.

    ``purge_step``: on resume from optimizer step t pass t + 1, so TensorBoard drops the events a crashed run
    wrote after its last checkpoint and the step axis continues in the same directory.
    """

    def __init__(
        self,
        is_main: bool,
        tensorboard_dir: str | Path | None = None,
        purge_step: int | None = None,
        wandb_settings: dict[str, Any] | None = None,
    ) -> None:
        self._tb = None
        self._wandb = None
        if not is_main:
            return
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            Path(tensorboard_dir).mkdir(parents=True, exist_ok=True)
            self._tb = SummaryWriter(log_dir=str(tensorboard_dir), purge_step=purge_step)
        if wandb_settings is not None:
            self._wandb = _init_wandb(**wandb_settings)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Write finite scalars at ``step`` (names like ``train/loss``); a NaN never reaches the dashboards."""
        finite = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if self._tb is not None:
            for key, value in finite.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None and finite:
            self._wandb.log(finite, step=step)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _init_wandb(
    project: str, mode: str, dir: str | Path, config: dict | None = None, name: str | None = None
):
    """Start a W&B run. ``mode="offline"`` writes under ``dir/wandb`` and needs no network or login."""
    import wandb

    Path(dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=project, mode=mode, dir=str(dir), config=config, name=name)


class ProgressBar:
    """tqdm over optimizer steps on the main rank, showing the step's loss, kl and margin; silent elsewhere."""

    def __init__(self, is_main: bool, total: int | None, initial: int = 0) -> None:
        # In a log file (SLURM, CI, colossalai run's pipes) every refresh is appended: refresh rarely there.
        interactive = sys.stderr.isatty()
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc="train",
            disable=not is_main,
            dynamic_ncols=True,
            mininterval=0.1 if interactive else 30.0,
        )

    def update(self, metrics: dict[str, float]) -> None:
        shown = {"loss": "train/loss", "kl": "train/kl", "margin": "train/rewards/margin"}
        self._bar.set_postfix(
            {short: f"{metrics[key]:.4f}" for short, key in shown.items() if key in metrics}, refresh=False
        )
        self._bar.update(1)

    def write(self, line: str) -> None:
        self._bar.write(line)

    def close(self) -> None:
        self._bar.close()
