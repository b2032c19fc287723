"""The upper bounds of the config's numbers (a value past them failed deep in numpy, torch or timedelta, with a
traceback, after the config was taken), and where ``data.prepared_dir`` may not lie beside ``output.dir``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

# Token counts: the prepared data's token columns are int32 (Arrow's list offsets too: coati_kto.data.ragged).
MAX_TOKENS = 2**31 - 1
# Seeds: numpy's legacy seed takes 0 .. 2**32 - 1 (torch.manual_seed takes more).
MAX_SEED = 2**32 - 1
# Timeouts, seconds: 10 days; far inside what timedelta, the process group and the store take.
MAX_TIMEOUT_S = 10 * 24 * 3600.0
# What a run writes under output.dir and replaces or deletes (output.overwrite): coati_kto.runtime.run_dir's
# RUN_OUTPUTS (the config layer may not import it; tests/unit/config/test_config_limits.py keeps them equal).
RUN_OUTPUTS = ("checkpoints", "tensorboard", "final", "exports", "wandb")

# The field types with those bounds (a key's own ge/gt and default stay on its Field).
Tokens = Annotated[int, Field(le=MAX_TOKENS)]
Seed = Annotated[int, Field(le=MAX_SEED)]
Seconds = Annotated[float, Field(le=MAX_TIMEOUT_S)]


def home_expanded(path: str) -> str:
    """``~/x`` (``~user/x``) as the folder it names: transformers and the Hub client take ``~/x`` for a Hub id,
    and ``Path("~/x").mkdir`` makes a folder named ``~``. Any other value as given. A ValueError when a folder
    literally named so exists here (what a run given ``~/x`` before wrote): which one is meant cannot be told."""
    if not path.startswith("~"):
        return path
    expanded = os.path.expanduser(path)
    if expanded != path and Path(path).exists():
        raise ValueError(
            f"./{path} exists here (a folder named ~, as runs before coati-kto read ~ as the home folder "
            f"made it), and ~ now means {os.path.expanduser('~')}: move it to {expanded}, or write ./{path}"
        )
    return expanded


# A path: "" would be the working directory, or nothing at all.
Text = Annotated[str, Field(min_length=1), AfterValidator(home_expanded)]


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def prepared_dir_overlap(prepared_dir: str, output_dir: str) -> list[str]:
    """A line when ``data.prepared_dir`` and ``output.dir`` (relative ones: from the working directory, links
    followed) share a directory that one of them replaces: ``prepare`` rebuilds prepared_dir by rename (a run
    inside it went with the old copy), and a run replaces or deletes its outputs under output.dir."""
    prepared, out = Path(prepared_dir).resolve(), Path(output_dir).resolve()
    rebuild = (
        "`prepare` with changed settings replaces data.prepared_dir whole, deleting the run's checkpoints"
    )
    fix = "give them separate directories (or leave data.prepared_dir unset: output.dir/prepared)"
    if prepared == out:
        return [f"data.prepared_dir and output.dir are the same directory ({out}): {rebuild}; {fix}"]
    if _inside(out, prepared):
        return [f"output.dir {out} is inside data.prepared_dir {prepared}: {rebuild}; {fix}"]
    for name in RUN_OUTPUTS:
        if _inside(prepared, out / name):
            return [
                f"data.prepared_dir {prepared} is inside output.dir's {name}/, which a run replaces (and "
                f"output.overwrite deletes), the prepared data with it; {fix}"
            ]
    return []
