"""A complete build of ``data.prepared_dir`` opened for reading (:mod:`coati_kto.data.store` builds it): the
splits memory-mapped as ``datasets`` saved them, stats.json, and an image build's images
(:mod:`coati_kto.data.image_table`), memory-mapped too."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import datasets
import pyarrow as pa

from coati_kto.data.image_table import PreparedImages, open_images
from coati_kto.data.store_check import unreadable


@dataclass
class PreparedData:
    """The opened splits (``eval`` None without an eval split), stats.json's contents and, for an image build,
    the images the rows' ``images`` column references (None for a text build)."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    stats: dict
    images: PreparedImages | None = None


def read_prepared(prepared_dir: str | Path) -> PreparedData:
    """Open the splits, stats.json and images of a complete build in ``prepared_dir`` (memory-mapped arrow)."""
    target = Path(prepared_dir)
    try:
        stats = json.loads((target / "stats.json").read_text())
        train = datasets.load_from_disk(str(target / "train"))
        evaluation = datasets.load_from_disk(str(target / "eval")) if (target / "eval").is_dir() else None
        images = open_images(target)
    except (OSError, ValueError, pa.ArrowException) as err:  # deleted or cut short since it was checked
        raise unreadable(target, err) from None
    return PreparedData(train=train, eval=evaluation, stats=stats, images=images)
