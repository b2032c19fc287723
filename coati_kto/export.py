"""``coati-kto export CONFIG [--checkpoint auto|DIR] [--out DIR]``: a run's checkpoint as the Hugging Face model
(and model card) that training writes at its end, to evaluate a run part-way or to recover an export that was
lost. Every rank calls ``export_checkpoint``.

It sets up as the run did (data, tokenizer, plugin, policy, optimizer: ``coati_kto.train``), loads the checkpoint
as a resume does and writes the export as the end of training does (``train._save_final``): the same files, the
same dtype rules (output.export_dtype), LoRA adapters and merged weights as output.merge_lora says. No reference
model is built. For an fp32 export of a bf16 run, run it on the layout the checkpoint was saved on
(``--nproc-per-node N``): the fp32 masters are per rank, and on another layout they are rebuilt from the working
weights (a warning says so).

output.dir is only read: a run still training there is not disturbed (its lock is not taken), and nothing is
written under output.dir except the export itself (default ``output.dir/exports/step-N``).
"""

from __future__ import annotations

from pathlib import Path

from coati_kto.config.resume import check_resume
from coati_kto.config.schema import Config
from coati_kto.errors import UserError
from coati_kto.parallel.distributed import on_rank0
from coati_kto.runtime.run_dir import CHECKPOINTS_DIR, COMPLETE, resolve_checkpoint
from coati_kto.runtime.signals import STOP
from coati_kto.train import _save_final, _setup, _setup_trainer

EXPORTS_DIR = "exports"


def export_checkpoint(config: Config, checkpoint: str = "auto", out: str | None = None) -> Path:
    """Write ``checkpoint`` (``auto``: the latest complete one under output.dir/checkpoints; or a step-N
    directory) as a Hugging Face model into ``out`` (default output.dir/exports/step-N), which must not exist
    yet. Returns the export's path. Every rank calls; user mistakes raise UserError (one line)."""
    from coati_kto.parallel.compat import quiet_known_warnings

    quiet_known_warnings()  # before anything imports colossalai: it warns at import time
    out_dir = Path(config.training_output().dir)
    root = out_dir / CHECKPOINTS_DIR
    _target(root, checkpoint, out)  # a missing checkpoint or an existing target: said before anything heavy
    # The optimizer is built (it holds the fp32 masters) but the reference model is not: nothing is scored.
    unscored = config.model_copy(update={"kto": config.kto.model_copy(update={"reference": "cached"})})
    run = _setup(config, heartbeat=None, training=False)
    trainer, frozen_fp32 = _setup_trainer(unscored, run, STOP.install())
    # Rank 0 decides (a run still training there may have saved another since the check above).
    path, target = on_rank0(lambda: _target(root, checkpoint, out), "find the checkpoint")
    saved = trainer.checkpoint_manager.saved_state(path).get("config")
    if saved is not None:  # refuses another model, tokenizer, LoRA or data than the checkpoint's
        check_resume(saved, config.model_dump(mode="json"), path.name)
    trainer.resume(path)
    _save_final(config, run, trainer, frozen_fp32, final_dir=target)
    return target


def _target(root: Path, checkpoint: str, out: str | None) -> tuple[Path, Path]:
    """(the checkpoint to export, the directory to write); raises UserError (one line) when there is no such
    checkpoint or the directory exists. Filesystem only; creates the directory's parent."""
    if checkpoint != "auto" and not (Path(checkpoint) / COMPLETE).is_file():
        raise UserError(
            f"coati-kto export --checkpoint: {checkpoint} is not a complete checkpoint (a checkpoints/step-N "
            f"directory with its {COMPLETE} marker)"
        )
    path = resolve_checkpoint(root, checkpoint)
    if path is None:
        raise UserError(f"coati-kto export: no complete checkpoint under {root}")
    target = Path(out) if out else root.parent / EXPORTS_DIR / path.name
    if target.exists():
        raise UserError(f"coati-kto export: {target} exists; remove it or name another with --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    return path, target
