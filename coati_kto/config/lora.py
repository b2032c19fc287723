"""The ``peft.LoraConfig`` a ``model.lora`` section stands for: one definition for the preflight's check on the
meta model (coati_kto.runtime.preflight) and the run's adapters (coati_kto.models.lora)."""

from __future__ import annotations

from typing import Any

from coati_kto.config.schema import LoraSection


def peft_config(section: LoraSection) -> Any:
    """The ``peft.LoraConfig`` of a ``model.lora`` section (causal LM, no bias trained)."""
    import peft  # the config layer imports no model library until asked

    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=section.rank,
        lora_alpha=section.alpha,
        lora_dropout=section.dropout,
        target_modules=list(section.target_modules),
        bias="none",
    )
