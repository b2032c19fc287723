"""The output directory of a run, ``output.dir``: what lives where, and which checkpoint counts.

::

    output.dir/
      config.yaml            the resolved config (rank 0)
      tensorboard/           event files (rank 0)
      wandb/                 W&B offline runs (rank 0), when logging.wandb
      checkpoints/step-N/    one checkpoint; it counts only once its COMPLETE marker is written
      checkpoints/latest     the name of the newest complete step-N
      final/                 the trained model in Hugging Face format (+ README.md, the model card)

Filesystem reads only here (no collectives, no torch import), so preflight and the checkpoint manager
share one definition of "a complete checkpoint"; ``clear_previous_run`` is the one writer, on rank 0.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from coati_kto.errors import UserError

CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
COMPLETE = "COMPLETE"
LATEST = "latest"
STEP_DIR = re.compile(r"step-(\d+)")
# What a run writes under output.dir that a second run would mix with (output.overwrite clears these).
RUN_OUTPUTS = (CHECKPOINTS_DIR, TENSORBOARD_DIR, FINAL_DIR, "wandb")


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step-N`` directories under ``root`` (a ``checkpoints/`` directory), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name)[1]))


def resolve_checkpoint(root: Path, resume: str | None) -> Path | None:
    """``train.resume`` resolved against ``root``: None -> None; 'auto' -> the latest complete checkpoint, or
    None; a path -> that checkpoint. Raises UserError (one line) for a path that is missing or incomplete."""
    if resume is None:
        return None
    if resume == "auto":
        pointer = root / LATEST
        if pointer.is_file():
            named = root / pointer.read_text().strip()
            marker = named / COMPLETE
            if marker.is_file():
                # A save killed between its rename into step-N and the pointer's update leaves the pointer on
                # an older checkpoint: a checkpoint completed after the one named is the newer one.
                later = [
                    p
                    for p in complete_checkpoints(root)
                    if (p / COMPLETE).stat().st_mtime_ns > marker.stat().st_mtime_ns
                ]
                return max(later, key=lambda p: (p / COMPLETE).stat().st_mtime_ns) if later else named
        complete = complete_checkpoints(root)  # pointer missing or stale: the highest complete step
        return complete[-1] if complete else None
    path = Path(resume)
    if not path.is_dir():
        raise UserError(
            f"train.resume: checkpoint {path} does not exist (train.resume=auto picks the latest one)"
        )
    if not (path / COMPLETE).is_file():
        raise UserError(
            f"train.resume: {path} is not a complete checkpoint (no {COMPLETE} marker: its save was interrupted, "
            "or it is not a step-N directory); use train.resume=auto or another step-N"
        )
    return path


def previous_run(out_dir: Path) -> list[str]:
    """What an earlier run left in ``out_dir`` (``checkpoints/step-3``, ``tensorboard/``...); empty when none."""
    found = []
    checkpoints = out_dir / CHECKPOINTS_DIR
    if checkpoints.is_dir():
        found += sorted(
            f"{CHECKPOINTS_DIR}/{p.name}" for p in checkpoints.iterdir() if p.name.startswith("step-")
        )
    if any((out_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*")):
        found.append(f"{TENSORBOARD_DIR}/ events")
    if (out_dir / FINAL_DIR).is_dir():
        found.append(f"{FINAL_DIR}/")
    return found


def clear_previous_run(out_dir: Path) -> None:
    """output.overwrite: global rank 0 deletes the earlier run's outputs (RUN_OUTPUTS); every rank calls, after
    the process group exists, and returns once they are gone."""
    # Imported here: preflight reads this module before anything heavy, and torch costs seconds to import.
    from coati_kto.parallel.distributed import barrier, global_rank

    if global_rank() == 0:
        for name in RUN_OUTPUTS:
            if (out_dir / name).exists():
                shutil.rmtree(out_dir / name)
    barrier()
