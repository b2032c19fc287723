"""The output directory of a run, ``output.dir``: what lives where, and which checkpoint counts.

::

    output.dir/
      config.yaml            the resolved config (rank 0)
      tensorboard/           event files (rank 0)
      wandb/                 W&B offline runs (rank 0), when logging.wandb
      checkpoints/step-N/    one checkpoint; it counts only once its COMPLETE marker is written
      checkpoints/latest     the name of the newest complete step-N
      checkpoints/fork.json  the lineage a hand resume started (coati_kto.runtime.lineage)
      final/                 the trained model in Hugging Face format (+ README.md, the model card)
      exports/step-N/        `coati-kto export`'s models of earlier checkpoints (its default --out)
      .run.lock              held (flock) by global rank 0 while a run trains here; names its pid and host

Filesystem reads only here (no collectives; torch imported only to read a trainer state), so preflight and the checkpoint manager
share one definition of "a complete checkpoint"; ``clear_previous_run`` is the one writer, on rank 0. Which
checkpoint a resume takes: ``coati_kto.runtime.lineage``.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
from pathlib import Path
from typing import BinaryIO

from coati_kto.errors import UserError
from coati_kto.locks import holder_line, probe
from coati_kto.runtime.durable import own_names

CONFIG_FILE = "config.yaml"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
FINAL_DIR = "final"
EXPORTS_DIR = "exports"  # coati-kto export's default target: exports/step-N
COMPLETE = "COMPLETE"
LATEST = "latest"
FORK = "fork.json"  # beside LATEST: the lineage a hand resume started (coati_kto.runtime.lineage)
TRAINER_STATE_DIR = "trainer_state"  # in a checkpoint: rank-R.pt, each rank's trainer state and RNG
MASTER_WEIGHTS_DIR = "master_weights"  # in a checkpoint: rank-R.pt, each rank's fp32 master shard
STEP_DIR = re.compile(r"step-(\d+)")
# What a run writes under output.dir that a second run would mix with (output.overwrite clears these).
RUN_OUTPUTS = (CHECKPOINTS_DIR, TENSORBOARD_DIR, FINAL_DIR, EXPORTS_DIR, "wandb")
RUN_LOCK = ".run.lock"
_held: dict[Path, BinaryIO] = {}  # output.dir -> its open lock file, on the rank that holds it


def checkpoint_step(checkpoint: Path) -> int:
    """N of a ``step-N`` directory; -1 for another name (a pointer edited by hand)."""
    match = STEP_DIR.fullmatch(checkpoint.name)
    return int(match[1]) if match else -1


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete ``step-N`` directories under ``root`` (a ``checkpoints/`` directory), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_meta(checkpoint: Path) -> dict:
    """``checkpoint/meta.json`` (step, layout, ``id`` and ``previous``: see ``coati_kto.runtime.lineage``); {}
    when it is missing or unreadable."""
    try:
        return json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def saved_trainer_state(checkpoint: Path, rank: int = 0) -> dict:
    """``checkpoint/trainer_state/rank-R.pt`` as the checkpoint manager wrote it: ``trainer_state`` (the data
    position, ``config``, the contents' digests), ``rng`` and ``loss_scaler`` (fp16; absent from checkpoints before
    2026-11-30). Raises FileNotFoundError when it is not there, and UserError (one line) when it holds anything
    but tensors, plain data and numpy arrays: a checkpoint can come from elsewhere (a Hub repo, another user's
    run), and unpickling any other object can run code."""
    import pickle

    import torch  # here only: preflight reads this module before anything heavy

    path = checkpoint / TRAINER_STATE_DIR / f"rank-{rank}.pt"
    try:
        with torch.serialization.safe_globals(numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise refused_pickle(path, err) from None


def numpy_globals() -> list:
    """What a checkpoint's numpy arrays and scalars unpickle through (an image TensorBoard logged, kept to write its
    step again after a resume; numpy's RNG key before 2026-12-02), under numpy 2's module names and numpy 1's
    (``numpy.core``): array reconstruction, never a callable of the file's choosing."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    build = [core.multiarray._reconstruct, core.multiarray.scalar]
    named = [(f, f"numpy.{spelled}.multiarray.{f.__name__}") for f in build for spelled in ("core", "_core")]
    dtypes = {type(np.dtype(code)) for code in np.typecodes["All"]}
    return [*named, np.ndarray, np.dtype, *sorted(dtypes, key=str)]


def refused_pickle(path: Path, err: Exception) -> UserError:
    """The one line for a checkpoint file torch.load(weights_only=True) refused (``err``): it holds objects
    besides tensors and plain data, which no checkpoint coati-kto writes does, and unpickling them could run code."""
    found = re.search(r"(?:Unsupported global: GLOBAL|unsupported GLOBAL) (\S+)", str(err))
    return UserError(
        f"{path}: holds {found[1] if found else 'an object'} besides tensors and plain data, which no checkpoint "
        "coati-kto writes holds; refused (loading it could run code): resume or export only checkpoints you trust"
    )


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
    found += [f"{name}/" for name in (FINAL_DIR, EXPORTS_DIR) if (out_dir / name).is_dir()]
    return found


def clear_previous_run(out_dir: Path) -> None:
    """output.overwrite: global rank 0 deletes the earlier run's outputs (RUN_OUTPUTS) and our own scratch
    copies of them beside them (``.final.coati-kto-old-XXXXXXXX``: ``durable.own_names``), nothing else; every
    rank calls, after the process group exists, and returns once they are gone. One that cannot be deleted
    raises UserError (one line) on every rank."""
    # Imported here: preflight reads this module before anything heavy, and torch costs seconds to import.
    from coati_kto.parallel.distributed import on_rank0

    def delete() -> None:
        for name in RUN_OUTPUTS:
            # A killed write's old or new copy of final/, an export's scratch data: the earlier run's too.
            for path in [out_dir / name, *own_names(out_dir, name)]:
                try:
                    if path.is_dir():
                        shutil.rmtree(path)
                    elif path.exists():  # a file of ours (durable.write_file's scratch copy)
                        path.unlink()
                except OSError as err:
                    where = f": {err.filename}" if err.filename else ""
                    raise UserError(
                        f"output.overwrite: {path} could not be deleted ({err.strerror or err}{where})"
                    ) from None

    # Its outcome reaches every rank: a failure raised on rank 0 alone left the others waiting for
    # train.file_wait_timeout where nothing told them (library use, a node whose launcher outlived rank 0's).
    on_rank0(delete, "delete the earlier run's outputs")


def lock_holder(out_dir: Path) -> str | None:
    """Who holds ``out_dir``'s run lock ("pid 41 on node1 since 2026-11-25 21:30:02"), or None when no run
    does (or the filesystem has no locks). Takes a shared lock for a moment, so it is for the launcher side
    only: a rank probing after its rank 0 claimed the directory would find its own run."""
    return probe(out_dir / RUN_LOCK)


def claim_output_dir(out_dir: Path) -> str | None:
    """Global rank 0: lock ``out_dir`` for this run (until ``release_output_dir``), so that a second run there
    (a relaunch while the old ranks still live, two jobs given one directory) is refused instead of writing
    into the same checkpoints. The kernel drops the lock when the process dies, so a killed run leaves none.

    Raises UserError (one line) naming the holder; returns a note when the filesystem has no locks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    handle = open(out_dir / RUN_LOCK, "a+b")  # noqa: SIM115 - held open for the whole run
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)  # "a+" opens at the end
        holder = handle.read().decode(errors="replace").strip() or "holder unknown"
        handle.close()
        raise UserError(in_use(out_dir, holder)) from None
    except OSError as err:  # ENOLCK / EOPNOTSUPP: a filesystem without locks
        handle.close()
        return (
            f"note: output.dir {out_dir} cannot be locked ({err.strerror or err}): a second run started there "
            "would not be refused"
        )
    handle.seek(0)
    handle.truncate()
    handle.write(holder_line().encode())
    handle.flush()
    _held[out_dir.resolve()] = handle
    return None


def release_output_dir(out_dir: Path) -> None:
    """End of the run (any rank may call; only the holder has something to release)."""
    handle = _held.pop(out_dir.resolve(), None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def in_use(out_dir: Path, holder: str) -> str:
    return (
        f"output.dir: {out_dir} is in use by a run still training there ({holder}): wait for it to end or stop "
        "it, or use another output.dir"
    )
