"""Trainers: SLTrainer base, KTOTrainer, checkpoints."""

from coati_kto.trainer.base import SLTrainer
from coati_kto.trainer.kto import KTOTrainer, NonFiniteLossError

__all__ = ["KTOTrainer", "NonFiniteLossError", "SLTrainer"]
