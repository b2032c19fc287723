"""The KTO trainer: ``KTOTrainer`` (on ``SLTrainer``) runs the step and the loops.

Beside it live the scoring plan, the passes, the loss, metrics, logging, the LR schedule, throughput and
checkpoints. The reference-log-prob cache lives in ``coati_kto.reference``, the model card and the Hub push in
``coati_kto.outputs``.

May import: models, parallel, data, runtime, config, families, errors. ``KTOTrainer`` and ``SLTrainer`` are
the public surface (ColossalChat's constructor signature).
"""

from typing import Any

__all__ = ["KTOTrainer", "NonFiniteLossError", "SLTrainer"]


def __getattr__(name: str) -> Any:
    # Resolved on first use: importing a light module of this package (schedule, options) must not import
    # colossalai (seconds, and warnings the recipe silences first), which the trainer itself does.
    if name == "SLTrainer":
        from coati_kto.trainer.base import SLTrainer

        return SLTrainer
    if name in ("KTOTrainer", "NonFiniteLossError"):
        from coati_kto.trainer import kto

        return getattr(kto, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
