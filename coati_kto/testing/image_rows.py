"""Hand-made image rows (``images``: each row's image bytes) in the prepared layout (coati_kto.data.image_table):
the rows with references, and the images they reference, held in memory, for a KTOCollator's ``image_table``."""

from __future__ import annotations

from typing import Any

from coati_kto.data.image_refs import digest
from coati_kto.data.image_table import PreparedImages


class HeldImages:
    """A split's images held in memory, found by digest as :class:`~coati_kto.data.image_table.SplitImages`
    finds them on disk."""

    def __init__(self, images: list[bytes]) -> None:
        self.by_digest = {digest(image): image for image in images}

    def __len__(self) -> int:
        return len(self.by_digest)

    def find(self, ref: bytes) -> bytes | None:
        return self.by_digest.get(bytes(ref))


def stored(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], PreparedImages]:
    """(``rows`` with each image replaced by its reference, the images they reference): as prepare stores them."""
    images = [image for row in rows for image in row.get("images") or ()]
    refs = [dict(row, images=[digest(image) for image in row.get("images") or ()]) for row in rows]
    return refs, PreparedImages([HeldImages(images)])
