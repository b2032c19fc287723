"""The ``output`` and ``logging`` sections: where a run writes, and what it logs to."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coati_kto.config.limits import Text
from coati_kto.config.push import PushToHubSection
from coati_kto.config.section import Section


class OutputSection(Section):
    dir: Text = Field(description="Run directory: config.yaml, tensorboard/, checkpoints/, final/.")
    save_interval: int = Field(0, ge=0, description="Checkpoint every N optimizer steps; 0: only at the end.")
    keep_last: int = Field(
        2,
        ge=1,
        description="Checkpoints kept: the one just saved and those of lower steps; older ones are deleted.",
    )
    save_final: bool = Field(
        True, description="Export final/ (HF model, tokenizer, README.md model card) at the end."
    )
    merge_lora: bool = Field(
        False,
        description="With model.lora: also write final/merged/, the adapters merged into the base model (needs "
        "save_final; `coati-kto export` writes it from a checkpoint).",
    )
    overwrite: bool = Field(
        False,
        description="Start over in a dir holding a run: delete its checkpoints, events, final model, exports and "
        "wandb/.",
    )
    push_to_hub: PushToHubSection | None = Field(
        None,
        json_schema_extra={"accepts": "str | mapping | null"},  # OWNER/NAME alone is the repo_id (push.py)
        description="Upload final/ and its card to a Hub repo at the end: OWNER/NAME, or {repo_id, private, revision}.",
    )
    export_dtype: Literal["training", "fp32"] = Field(
        "training",
        description="final/'s weights: training (the working weights, e.g. bf16) or fp32 (the optimizer's fp32 "
        "master weights after bf16 training; tensor-parallel size 1, no LoRA; fp32 needs save_final, or `coati-kto "
        "export`).",
    )

    def _problems(self) -> list[str]:
        # Both shape final/ only (outputs/weights.py); without it training writes nothing they apply to, while
        # `coati-kto export` applies both to a checkpoint, in its own directory (recipe/export.py, recipe/save.py).
        given: dict[str, tuple[str, str]] = {}  # the override -> (the key as set, what export writes for it)
        if self.merge_lora:
            given["output.merge_lora=true"] = ("output.merge_lora true", "merged/")
        if self.export_dtype == "fp32":
            given["output.export_dtype=fp32"] = ("output.export_dtype fp32", "the fp32 weights")
        if self.save_final or not given:
            return []
        they, them = ("it", "it") if len(given) == 1 else ("they", "them")
        keys, writes = (" and ".join(parts) for parts in zip(*given.values(), strict=True))
        return [
            f"{keys} with output.save_final false: training writes no final/, so {they} would do nothing; set "
            f"output.save_final=true, or remove {them} and run `coati-kto export CONFIG "
            f"{' '.join(given)} output.save_final=true` later (it writes {writes} from a checkpoint)"
        ]


class LoggingSection(Section):
    tensorboard: bool = Field(True, description="Write TensorBoard events under output.dir/tensorboard.")
    wandb: bool = Field(False, description="Log to Weights & Biases.")
    wandb_project: str = Field("coati-kto", description="W&B project name.")
    wandb_mode: Literal["online", "offline"] = Field("online", description="offline: write under output.dir.")
