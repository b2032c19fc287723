"""What ``coati-kto export`` checks and where it writes, before anything is loaded (filesystem only).

The export itself is a recipe (``coati_kto.recipe.export``): set up as the run did, load the checkpoint, write
the weights and the card as the end of training does.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from coati_kto.config.lora import LoraSection
from coati_kto.config.output import OutputSection
from coati_kto.config.schema import PluginSection
from coati_kto.errors import UserError
from coati_kto.outputs.model_card import CARD
from coati_kto.runtime.lineage import resume_choice
from coati_kto.runtime.preflight import push_problems
from coati_kto.runtime.run_dir import CHECKPOINTS_DIR, COMPLETE, EXPORTS_DIR, FINAL_DIR
from coati_kto.runtime.target_lock import TargetBusyError, holder, release, take


def finished_final(output: OutputSection, checkpoint: str, out: str | None) -> Path | None:
    """output.dir/final when ``export --push`` should upload it as it is: no checkpoint or --out named, and its
    model card written (the card is written last: the end of a finished run). None: export a checkpoint first."""
    final = Path(output.dir) / FINAL_DIR
    return final if checkpoint == "auto" and out is None and (final / CARD).is_file() else None


def check_push(output: OutputSection) -> None:
    """``export --push``: a repo id and a token, before anything is loaded (UserError, one line each)."""
    problems = push_problems(output, exporting=True)
    if problems:
        raise UserError("\n".join(problems))


def check_masters_layout(
    output: OutputSection,
    lora: LoraSection | None,
    plugin: PluginSection,
    path: Path,
    world_size: int | None = None,
) -> None:
    """UserError (one line) for output.export_dtype fp32 of a bf16/fp16 checkpoint (``path``) on another layout
    than it was saved on: its fp32 masters are per rank and would be rebuilt from the working weights, so the
    export would hold the working weights cast to fp32 under a card and a line that call them the fp32 masters.
    ``world_size``: the processes the export runs on (default: this process's WORLD_SIZE; the launcher passes
    its --nproc-per-node)."""
    if output.export_dtype != "fp32" or lora is not None:
        return
    if plugin.precision == "fp32" or not (path / "meta.json").is_file():
        return
    meta = json.loads((path / "meta.json").read_text())
    # The layout CheckpointManager.load restores the masters on: every size (dp follows from the others).
    now = {"world_size": world_size or int(os.environ.get("WORLD_SIZE", "1"))}
    now |= {"tp_size": plugin.tp_size, "sp_size": plugin.sp_size, "pp_size": plugin.pp_size}
    saved = {key: int(meta.get(key, 1)) for key in now}  # sp and pp: absent before they existed, 1
    if now != saved:
        sizes = ("tp_size", "sp_size", "pp_size")
        at = ", ".join(f"plugin.{k} {saved[k]}" for k in sizes)
        here = ", ".join(str(now[k]) for k in sizes)
        raise UserError(
            f"coati-kto export: output.export_dtype fp32 writes the fp32 master weights, which {path.name} holds "
            f"per rank for {saved['world_size']} process(es) at {at}, not {now['world_size']} at {here} (they "
            f"would be rebuilt from the {plugin.precision} weights): run it with --nproc-per-node "
            f"{saved['world_size']} and "
            + " ".join(f"plugin.{k}={saved[k]}" for k in sizes)
            + ", or output.export_dtype=training"
        )


def export_target(root: Path, checkpoint: str, out: str | None, say: bool = False) -> tuple[Path, Path]:
    """(the checkpoint to export, the directory to write) under the run's checkpoints directory ``root``; raises
    UserError (one line) when there is no such checkpoint, it is damaged (``auto`` passes over a damaged one to
    the intact one before it: ``say`` prints that warning, on global rank 0), or the directory exists. Creates
    the directory's parent."""
    if checkpoint != "auto" and not (Path(checkpoint) / COMPLETE).is_file():
        raise UserError(
            f"coati-kto export --checkpoint: {checkpoint} is not a complete checkpoint (a checkpoints/step-N "
            f"directory with its {COMPLETE} marker)"
        )
    path, warning = resume_choice(root, checkpoint, key="coati-kto export --checkpoint")
    if path is None:
        raise UserError(f"coati-kto export: no complete checkpoint under {root}")
    if warning is not None and say and os.environ.get("RANK", "0") == "0":
        print(warning, file=sys.stderr, flush=True)
    target = Path(out) if out else root.parent / EXPORTS_DIR / path.name
    if target.exists():
        raise UserError(_exists(target))
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a parent that is a file, a read-only mount, /proc: one line, as prepare's
        raise UserError(f"coati-kto export: cannot write {target} ({err.strerror or err})") from None
    if not os.access(target.parent, os.W_OK | os.X_OK):  # a read-only mount answers EROFS here, not at mkdir
        raise UserError(
            f"coati-kto export: cannot write {target} (its folder {target.parent} is not writable)"
        )
    return path, target


def _exists(target: Path) -> str:
    return f"coati-kto export: {target} exists; remove it or name another with --out"


def _busy(target: Path, who: str) -> str:
    return (
        f"coati-kto export: {target} is being written by another process ({who}); wait for it to end, or name "
        "another with --out"
    )


def claim_target(target: Path, checkpoint: Path) -> None:
    """Global rank 0, the export's writer: hold ``target``'s lock (``runtime.target_lock``) until
    ``release_target``, so that another export to it (a command re-run, a second job) is refused rather than
    deleting this one's directory mid-write or replacing it. ``target`` is checked again under the lock: an
    export that finished since :func:`export_target` looked is not replaced. UserError, one line."""
    try:
        take(target, f"coati-kto export of {checkpoint.name}")
    except TargetBusyError as err:
        raise UserError(_busy(target, err.holder)) from None
    except OSError as err:  # the lock file cannot be made where the export could not be written either
        raise UserError(f"coati-kto export: cannot write {target} ({err.strerror or err})") from None
    if target.exists():
        release(target)
        raise UserError(_exists(target))


def release_target(target: Path) -> None:
    """The end of :func:`claim_target`'s hold (removes its lock file)."""
    release(target)


def check_export(
    output: OutputSection,
    lora: LoraSection | None,
    plugin: PluginSection,
    options: tuple[str, str | None, bool],
    world_size: int,
) -> None:
    """What ``coati-kto export --nproc-per-node N`` (``world_size``) checks once in its launcher, before the ranks
    start (each rank raised the same line: N lines, or exit 1 once torchrun stopped the others). ``options``:
    --checkpoint, --out, --push. UserError, one line."""
    checkpoint, out, push = options
    if push:
        check_push(output)
        if finished_final(output, checkpoint, out) is not None:  # uploaded as it is: nothing to export
            return
    first, target = export_target(Path(output.dir) / CHECKPOINTS_DIR, checkpoint, out)
    if (who := holder(target)) is not None:  # rank 0 claims it; said here before N ranks start and load
        raise UserError(_busy(target, who))
    check_masters_layout(output, lora, plugin, first, world_size)
