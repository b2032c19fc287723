"""The base of every config section: unknown keys are errors, numbers given for strings are kept as text, and
NaN/inf are refused (``coati_kto.config.schema`` holds the sections); the sections without cross-key checks
(``output``, ``logging``) and the parsing of an ``auto``-or-number key."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, coerce_numbers_to_str=True, allow_inf_nan=False
    )


def auto_or_number(value: Any) -> float | str:
    """``auto``, or ``value`` as a finite float >= 0; one ValueError message for both (pydantic would report
    each member of the union on its own line)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = math.nan if isinstance(value, bool) else float(text)
    except ValueError:
        number = math.nan
    if not 0 <= number < math.inf:
        raise ValueError("must be auto or a number >= 0 (0: off)")
    return number


class OutputSection(Section):
    dir: str = Field(description="Run directory: config.yaml, tensorboard/, checkpoints/, final/.")
    save_interval: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0: only at the end.")
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    save_final: bool = Field(
        True, description="Export final/ (HF model, tokenizer, README.md model card) at the end."
    )
    merge_lora: bool = Field(
        False,
        description="With model.lora: also write final/merged/, the adapters merged into the base model.",
    )
    overwrite: bool = Field(
        False,
        description="Start over in a dir holding a run: delete its checkpoints, events and final model.",
    )
    export_dtype: Literal["training", "fp32"] = Field(
        "training",
        description="final/'s weights: training (the working weights, e.g. bf16) or fp32 (the optimizer's fp32 "
        "master weights after bf16 training; tensor-parallel size 1, no LoRA).",
    )


class LoggingSection(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard events under output.dir/tensorboard.")
    wandb: bool = Field(False, description="Log to Weights & Biases.")
    wandb_project: str = Field("coati-kto", description="W&B project name.")
    wandb_mode: Literal["online", "offline"] = Field("online", description="offline: write under output.dir.")
