"""The trained model in Hugging Face format: what ``final/`` (the end of training) and ``coati-kto export`` hold.

Full weights (``output.export_dtype``: the working weights, or the optimizer's fp32 masters) through the run's
checkpoint IO, or with ``model.lora`` the adapters (``adapter/``) and, with ``output.merge_lora``, the merged
model (``merged/``). Every rank calls (gathers are collectives); the main rank writes.
"""

from __future__ import annotations

import functools

from pathlib import Path
from typing import Any

import torch

from coati_kto.config.output import OutputSection
from coati_kto.parallel.masters import gathered_masters
from coati_kto.trainer.export import merged_over_stages


def write_weights(
    trainer: Any,
    tokenizer: Any,
    target: Path,
    output: OutputSection,
    lora: bool,
    is_main: bool,
    frozen_fp32: dict[str, torch.Tensor],
    again: str | None = None,
) -> Path:
    """Write ``trainer``'s policy (with ``tokenizer``) under ``target``; returns the directory that holds the model
    (``target``, or with ``lora`` the adapters' parent). ``frozen_fp32``: weights no optimizer master holds (a
    vision-language model's frozen tower), added to an fp32 export. ``again``: how to write it again, for a failed
    write's line (``CheckpointManager.write_final``; None: train.resume=auto from the latest checkpoint)."""
    # Imported here: after quiet_known_warnings (coati_kto.recipe.train).
    from coati_kto.models.lora import base_module, lora_adapters, write_lora

    if lora:  # target/adapter (peft) and, with output.merge_lora, target/merged: whole or absent, as full weights
        layout, gather = trainer.layout, None
        if layout.pp_size > 1:  # each stage holds its own layers' adapters
            module = base_module(trainer.policy)
            gather = functools.partial(merged_over_stages, module=module, group=layout.pp_group)
        adapters = lora_adapters(trainer.policy, gather)  # every rank
        write = functools.partial(write_lora, trainer.policy, adapters, tokenizer, merge=output.merge_lora)
        return trainer.checkpoint_manager.write_final(target, write, again)
    masters = None
    if output.export_dtype == "fp32":
        # a collective: every rank; kept where export_hf reads it (the writer, and each pipeline stage's own)
        kept = is_main or trainer.layout.pp_size > 1
        masters = gathered_masters(trainer.policy, trainer.optimizer, keep=kept)
        if kept:
            masters.update(frozen_fp32)
    return trainer.checkpoint_manager.export_hf(trainer.policy, tokenizer, target, masters, again)


def export_note(precision: str, export_dtype: str, where: str = "final/") -> str:
    """What the export's full weights are, in one line (the card repeats it). ``precision``: plugin.precision;
    ``export_dtype``: output.export_dtype; ``where``: final/, or step-N/ for coati-kto export."""
    if export_dtype == "fp32":
        return f"{where} holds the optimizer's fp32 master weights (trained in {precision}; output.export_dtype fp32)"
    if precision == "fp32":
        return f"{where} holds the fp32 weights the run trained"
    return (
        f"{where} holds the {precision} weights the run trained (its base was loaded in fp32 and cast); "
        "output.export_dtype=fp32 writes the fp32 master weights instead"
    )
