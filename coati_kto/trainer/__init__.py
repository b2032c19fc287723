"""The KTO trainer: ``KTOTrainer`` (on ``SLTrainer``) runs the step and the loops; beside it the loss, metrics,
logging, LR schedule, throughput, checkpoints, the reference-log-prob cache and the model card.

May import: models, parallel, data, runtime, config, families, errors. ``KTOTrainer`` and ``SLTrainer`` are
the public surface (ColossalChat's constructor signature).
"""

from coati_kto.trainer.base import SLTrainer
from coati_kto.trainer.kto import KTOTrainer, NonFiniteLossError

__all__ = ["KTOTrainer", "NonFiniteLossError", "SLTrainer"]
