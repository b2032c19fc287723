"""The end of a recipe: the trained model and its model card (``coati_kto.outputs``), under output.dir/final or
``coati-kto export``'s directory."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from coati_kto.config.schema import Config
from coati_kto.outputs.model_card import last_eval, render, write_card
from coati_kto.outputs.weights import export_note, write_weights
from coati_kto.parallel.distributed import on_rank0
from coati_kto.recipe.setup import Run
from coati_kto.runtime.run_dir import FINAL_DIR


def save_final(
    config: Config,
    run: Run,
    trainer: Any,
    frozen_fp32: dict[str, torch.Tensor],
    final_dir: Path | None = None,
    world_size: int | None = None,
) -> None:
    """The trained model in Hugging Face format under ``final_dir`` (output.dir/final, unless output.save_final is
    off), with its model card (every rank). ``coati-kto export`` names its directory and the processes the
    checkpoint was trained on (``world_size``, for the card)."""
    output = config.training_output()
    if final_dir is None and not output.save_final:
        return
    exported = final_dir is not None  # by coati-kto export, not at the end of training
    what = "exported model" if exported else "final model"
    final_dir = final_dir or run.out_dir / FINAL_DIR
    lora = config.model.lora is not None
    # how to write it again, for a failed write's line: train.resume=auto (the default there), or the export again
    rewrite = "run coati-kto export again" if exported else None
    final = write_weights(
        trainer, run.tokenizer, final_dir, output, lora, run.layout.is_main, frozen_fp32, rewrite
    )
    if not lora:
        run.notes.append(export_note(config.plugin.precision, output.export_dtype, f"{final_dir.name}/"))

    def card() -> None:
        world = world_size or run.layout.world_size
        eval_record, steps = last_eval(trainer.history), trainer.global_step
        text = render(config, run.data.stats, eval_record, steps, run.weights, world, run.notes)
        card_or_nothing(Path(final), text, rewrite or "train.resume=auto writes it again")
        print(f"{what}: {final}", flush=True)
        if not lora:
            print(run.notes[-1], flush=True)  # what its weights are

    # Global rank 0 writes; its outcome reaches every rank (a failed card's line, exit 2, on every rank at once:
    # raised on rank 0 alone, it left the others waiting for train.file_wait_timeout in train's wait for final/).
    on_rank0(card, f"write the {what}'s card")


def card_or_nothing(final: Path, card: str, again: str) -> None:
    """``card`` into ``final`` (synced: the card marks the export finished). A failure (the disk full after the
    weights) removes ``final``, whose weights without their card are no finished export, and raises the one line
    saying so and how to write it ``again``: it was a traceback, and an export's folder then refused a rerun."""
    # Imported here: this module is imported before coati_kto.recipe.train quiets ColossalAI's import warnings
    from coati_kto.trainer.checkpoint import CheckpointSaveError
    from coati_kto.trainer.write_failures import describe

    try:
        write_card(final, card)
    except OSError as err:
        shutil.rmtree(final, ignore_errors=True)
        raise CheckpointSaveError(
            f"the model card could not be written to {final} ({describe(err)}): removed {final.name}/; {again}"
        ) from None
