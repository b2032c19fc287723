"""A split's distinct images, stored once (issue 49): ``<split>/images.arrow`` beside the rows.

Image feedback rates several completions per image, so many rows share an image: stored per row, 40 records
sharing a 4.5 MB PNG made 180 MB of prepared data. The rows' ``images`` column holds instead each image's
reference, its sha256 (:func:`coati_kto.data.image_refs.digest`, 32 bytes), in the prompt's order; the split's
``images.arrow`` (Arrow IPC file: ``digest`` fixed_size_binary(32), ``bytes`` large_binary) holds every image a
kept row references, once, in order of first use. Readers resolve a row's references through
:class:`PreparedImages` (``PreparedData.images``): the same bytes, in the same order, as the rows held before.

The file is memory-mapped, as ``datasets`` maps the rows: opening it reads the digests (32 bytes an image) and
keeps a sorted 8-byte key per image for the look-up; the bytes are read from the page cache when a batch needs
them, never all at once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from coati_kto.data.ragged import kept_rows

if TYPE_CHECKING:
    import datasets

IMAGE_FILE = "images.arrow"  # in each split's folder of an image build
DIGEST = pa.binary(32)
IMAGE_REFS = pa.list_(pa.binary())  # a row's references (its images' digests), in the prompt's order
SCHEMA = pa.schema([("digest", DIGEST), ("bytes", pa.large_binary())])


def distinct_images(images: pa.ChunkedArray) -> tuple[pa.ChunkedArray, pa.Table]:
    """(each row's references, :data:`IMAGE_REFS`; the table of the distinct images, :data:`SCHEMA`, in order of
    first use) of ``images`` (list<large_binary>: each row's image bytes). Each image is hashed once where it is
    (no copy); the table's bytes are zero-copy slices of ``images``' buffers, written out by :func:`write`."""
    values = pa.chunked_array([chunk.flatten() for chunk in images.chunks], pa.large_binary())
    digests: list[bytes] = []
    first: dict[bytes, int] = {}  # digest -> its first image's position in ``values``
    for chunk in values.chunks:
        for value in _views(chunk):
            d = hashlib.sha256(value).digest()
            first.setdefault(d, len(digests))
            digests.append(d)
    counts = np.concatenate([c.value_lengths().to_numpy(zero_copy_only=False) for c in images.chunks] or [[]])
    offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int32)
    refs = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(digests, pa.binary()))
    positions = np.fromiter(first.values(), np.int64, len(first))  # increasing: first-use order
    table = pa.table(
        {"digest": pa.array(list(first), DIGEST), "bytes": kept_rows(values, positions)}, schema=SCHEMA
    )
    return pa.chunked_array([refs], IMAGE_REFS), table


def _views(values: pa.Array) -> list[memoryview]:
    """Each value of a large_binary array, in place (a scalar's ``as_buffer`` copies it)."""
    if len(values) == 0:
        return []
    _, offsets, data = values.buffers()
    ends = np.frombuffer(offsets, np.int64)[values.offset : values.offset + len(values) + 1].tolist()
    whole = memoryview(data if data is not None else b"")  # no data buffer: every value is empty
    return [whole[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]


def write(table: pa.Table, folder: Path) -> None:
    """``table`` (:func:`distinct_images`) as ``folder/images.arrow``."""
    with pa.OSFile(str(folder / IMAGE_FILE), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
        writer.write_table(table)


class SplitImages:
    """One split's ``images.arrow``, memory-mapped; pickled as its path (a DataLoader worker maps it again)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        table = pa.ipc.open_file(pa.memory_map(str(self.path), "r")).read_all()  # zero-copy over the map
        self._digests = table.column("digest").combine_chunks()
        self._bytes = table.column("bytes")
        buffer = self._digests.buffers()[1]
        words = np.frombuffer(buffer, ">u8", count=4 * len(self._digests), offset=32 * self._digests.offset)
        keys = words.reshape(-1, 4)[:, 0].astype(np.uint64)  # each digest's first 8 bytes, as a number
        self._order = np.argsort(keys, kind="stable")
        self._keys = keys[self._order]

    def __len__(self) -> int:
        return len(self._digests)

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return SplitImages, (self.path,)

    def find(self, ref: bytes) -> bytes | None:
        """The bytes of the image whose digest is ``ref``; None when this split holds none."""
        key = np.uint64(int.from_bytes(bytes(ref[:8]), "big"))
        lo, hi = np.searchsorted(self._keys, key, "left"), np.searchsorted(self._keys, key, "right")
        for row in self._order[lo:hi].tolist():  # one row, unless two digests share their first 8 bytes
            if self._digests[row].as_py() == bytes(ref):
                return self._bytes[row].as_py()
        return None


class PreparedImages:
    """The images of a prepared image build, by reference (a row's ``images``), over its splits: a train row
    and an eval row of one image resolve alike, so one collator serves both loaders."""

    def __init__(self, splits: list[SplitImages]) -> None:
        self.splits = splits

    def __len__(self) -> int:
        return sum(len(s) for s in self.splits)

    def bytes_of(self, ref: bytes) -> bytes:
        """The image ``ref`` references; ValueError when no split holds it (rows of another build)."""
        for split in self.splits:
            found = split.find(ref)
            if found is not None:
                return found
        raise ValueError(
            f"image {bytes(ref).hex()[:16]} of the row is not among the prepared images: the rows are another "
            "build's; prepare again"
        )

    def row_images(self, row: dict[str, Any]) -> list[bytes]:
        """A prepared row's image bytes, in its prompt's order ([] without images)."""
        return [self.bytes_of(ref) for ref in row.get("images") or ()]


def open_images(target: Path, splits: tuple[str, ...] = ("train", "eval")) -> PreparedImages | None:
    """The images of the build in ``target`` (memory-mapped), None for a text build (no ``images.arrow``)."""
    found = [SplitImages(target / s / IMAGE_FILE) for s in splits if (target / s / IMAGE_FILE).is_file()]
    return PreparedImages(found) if found else None


@dataclass
class PreparedSplit:
    """A built split (:func:`coati_kto.data.tables.build_split`): its rows, in memory, and for an image build the
    distinct images they reference (:func:`distinct_images`)."""

    rows: datasets.Dataset
    images: pa.Table | None = None

    def save_to_disk(self, path: str) -> None:
        """The rows as ``datasets`` saves them into folder ``path``, then the images beside them (``images.arrow``):
        how :mod:`coati_kto.data.store` saves a split."""
        self.rows.save_to_disk(path)
        if self.images is not None:
            write(self.images, Path(path))
