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

``--push`` uploads to output.push_to_hub: ``final/`` as it is when the run finished (no checkpoint or --out
named: the retry of a failed upload at the end of training; nothing is loaded), else the export just written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from coati_kto.config.resume import check_resume
from coati_kto.config.schema import Config
from coati_kto.errors import UserError
from coati_kto.parallel.distributed import on_rank0
from coati_kto.runtime.preflight import push_problems
from coati_kto.runtime.run_dir import (
    CHECKPOINTS_DIR,
    COMPLETE,
    FINAL_DIR,
    resolve_checkpoint,
    saved_trainer_state,
)
from coati_kto.runtime.signals import STOP
from coati_kto.train import _save_final, _setup, _setup_trainer
from coati_kto.trainer.push import push_folder

EXPORTS_DIR = "exports"
CARD = "README.md"  # written last into an export: final/ holding it is complete


def finished_final(config: Config, checkpoint: str, out: str | None) -> Path | None:
    """output.dir/final when ``export --push`` should upload it as it is: no checkpoint or --out named, and its
    model card written (the end of a finished run). None: export a checkpoint first."""
    final = Path(config.training_output().dir) / FINAL_DIR
    return final if checkpoint == "auto" and out is None and (final / CARD).is_file() else None


def check_push(config: Config) -> None:
    """``export --push``: a repo id and a token, before anything is loaded (UserError, one line each)."""
    problems = push_problems(config.training_output(), exporting=True)
    if problems:
        raise UserError("\n".join(problems))


def push(config: Config, folder: Path, what: str) -> bool:
    """Upload ``folder`` to output.push_to_hub and print the line saying how it went (one process)."""
    uploaded, line = push_folder(folder, config.training_output().push_to_hub, what)
    print(line, flush=True)
    return uploaded


def export_checkpoint(config: Config, checkpoint: str = "auto", out: str | None = None) -> Path:
    """Write ``checkpoint`` (``auto``: the latest complete one under output.dir/checkpoints; or a step-N
    directory) as a Hugging Face model into ``out`` (default output.dir/exports/step-N), which must not exist
    yet. Returns the export's path. Every rank calls; user mistakes raise UserError (one line)."""
    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()  # before anything imports colossalai: it warns at import time
    out_dir = Path(config.training_output().dir)
    root = out_dir / CHECKPOINTS_DIR
    # A missing checkpoint, an existing target, fp32 masters of another layout: said before anything heavy.
    first = _target(root, checkpoint, out)[0]
    _masters_problem(config, first)
    config = _run_config(config, first)
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
    trained_on = json.loads((path / "meta.json").read_text()).get("world_size")  # the card's process count
    _save_final(config, run, trainer, frozen_fp32, final_dir=target, world_size=trained_on)
    return target


def _masters_problem(config: Config, path: Path) -> None:
    """UserError (one line) for output.export_dtype fp32 of a bf16/fp16 checkpoint on another layout than it was
    saved on: its fp32 masters are per rank and would be rebuilt from the working weights, so the export would
    hold the working weights cast to fp32 under a card and a line that call them the fp32 masters."""
    if config.training_output().export_dtype != "fp32" or config.model.lora is not None:
        return
    if config.plugin.precision == "fp32" or not (path / "meta.json").is_file():
        return
    meta = json.loads((path / "meta.json").read_text())
    world, tp = int(os.environ.get("WORLD_SIZE", "1")), config.plugin.tp_size
    saved_world, saved_tp = meta.get("world_size"), meta.get("tp_size", 1)
    if (world, tp) != (saved_world, saved_tp):
        raise UserError(
            f"coati-kto export: output.export_dtype fp32 writes the fp32 master weights, which {path.name} holds "
            f"per rank for {saved_world} process(es) at plugin.tp_size {saved_tp}, not {world} at {tp} (they would "
            f"be rebuilt from the {config.plugin.precision} weights): run it with --nproc-per-node {saved_world} "
            f"and plugin.tp_size={saved_tp}, or output.export_dtype=training"
        )


def _run_config(config: Config, path: Path) -> Config:
    """The config the checkpoint was trained with (its output section and tensor-parallel size from ``config``):
    what the export and its card describe. Another model, tokenizer, LoRA or data is refused (check_resume); a
    changed training setting (kto.beta, train.lr...) would otherwise be written into the card as the run's."""
    saved = saved_trainer_state(path)["trainer_state"].get("config")
    if saved is None:
        return config
    check_resume(saved, config.model_dump(mode="json"), path.name)
    current = config.model_dump(mode="json")
    plugin = {**saved["plugin"], "tp_size": current["plugin"]["tp_size"]}
    data = {**saved["data"], **{k: current["data"][k] for k in ("prepared_dir", "num_proc")}}  # may move
    return Config.model_validate({**saved, "output": current["output"], "plugin": plugin, "data": data})


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
