"""Whether a prepared build on disk is whole (``coati_kto.data.store``): its stats.json, and for each split every
file its ``state.json`` names. A build some file of which was deleted since (a cleanup, a partial copy) is built
again rather than failing its read with a traceback; one that cannot be read whole is one line."""

from __future__ import annotations

import json
from pathlib import Path

from coati_kto.data.image_table import IMAGE_FILE
from coati_kto.errors import DataError

SPLITS = ("train", "eval")


def build_damage(target: Path) -> str | None:
    """What a build in ``target`` lacks ("train/data-00000-of-00001.arrow is missing"), or None when every file a
    read opens is there (an image build's ``images.arrow`` too). The eval split is optional; the train split is
    not."""
    if not (target / "stats.json").is_file():
        return "stats.json is missing"
    images = _image_build(target)
    for split in SPLITS:
        folder = target / split
        if not folder.is_dir():
            if split == "train":
                return "train/ is missing"
            continue
        try:
            state = json.loads((folder / "state.json").read_text())
            names = [entry["filename"] for entry in state["_data_files"]]
        except FileNotFoundError:
            return f"{split}/state.json is missing"
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"{split}/state.json is unreadable ({type(err).__name__})"
        names += [IMAGE_FILE] if images else []
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            return f"{split}/{missing[0]} is missing"
    return None


def _image_build(target: Path) -> bool:
    """Whether the build in ``target`` holds image rows: its fingerprint has images (every split then has its
    ``images.arrow``, :mod:`coati_kto.data.image_table`)."""
    try:
        return bool(json.loads((target / "fingerprint.json").read_text()).get("images"))
    except (OSError, ValueError, AttributeError):
        return False


def unreadable(target: Path, err: Exception) -> DataError:
    """The one line for a build whose files are there but do not read (an arrow file cut short)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return DataError(
        f"data.prepared_dir {target}: the prepared data cannot be read ({type(err).__name__}: {first[:200]}); "
        "remove the folder and the next prepare or train builds it again"
    )
