"""A split's image bytes past Arrow's binary limit (int32 offsets: 2^31 - 1 bytes a column; 11k images of 200 KB)
prepare: the encoded table holds them as large_binary, the split's distinct images (coati_kto.data.image_table)
are zero-copy slices of it rather than a copy, and the rows hold references that resolve to the records' bytes.

The split past 2 GiB is made without 2 GiB of memory: its image column's zeros are np.zeros pages never written.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from datasets.table import InMemoryTable
from PIL import Image
from transformers import Gemma3Config

from coati_kto.config.schema import Config
from coati_kto.data import tables
from coati_kto.data.collator import KTOCollator
from coati_kto.data.formats import Record
from coati_kto.data.image_table import PreparedSplit, open_images
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.tables import build_split
from coati_kto.testing.tiny_processors import gemma3_processor

SOFT = 473  # the tiny tokenizer's <image_soft_token> (test_image_tokenize pins it)
LONG = 3  # the record too long for data.max_length: dropped, so the kept rows are two runs
ROW_BYTES = 300 << 20  # each image padded to 300 MiB: 8 rows hold 2.3 GiB, past binary's 2^31 - 1
COLOURS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrepareSettings, list[Record], Path]:
    """(settings over a Gemma 3 config and the tiny processor, 8 image records, a scratch directory)."""
    root = tmp_path_factory.mktemp("image-bytes")
    processor = gemma3_processor()
    processor.save_pretrained(root / "vl")
    text = {"vocab_size": len(processor.tokenizer), "hidden_size": 16, "num_hidden_layers": 1}
    vision = {"hidden_size": 16, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}
    Gemma3Config(
        text_config=text, vision_config=vision, image_token_index=SOFT, mm_tokens_per_image=4
    ).save_pretrained(root / "vl")
    config = Config.model_validate(
        {
            "model": {"path": str(root / "vl")},
            "data": {
                "train_files": ["unused.jsonl"],
                "prepared_dir": str(root / "prepared"),
                "max_length": 64,
                "on_too_long": "skip",
            },
            "train": {"micro_batch_size": 2, "seed": 1},
            "output": {"dir": str(root / "out")},
        }
    )
    records = [
        Record(
            prompt=[
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour? ({i})"}]}
            ],
            completion=[{"role": "assistant", "content": "red " * (80 if i == LONG else 1)}],
            label=i % 2 == 0,
            source=f"train.jsonl:{i + 1}",
            chat=True,
            images=[png(COLOURS[i % 4], 32 + i)],
        )
        for i in range(8)
    ]
    return PrepareSettings(config.data, config.model, config.train.seed, True), records, root


def build(split, root: Path) -> PreparedSplit:
    settings, records, _ = split
    processor = gemma3_processor()
    built, _, _, left_out = build_split(
        records, processor.tokenizer, settings, root, "train", ["train.jsonl"], processor
    )
    assert [line.split("\t")[0] for line in left_out] == ["too_long"]  # record LONG: the rows are two runs
    return built


def past_2_gib(column: pa.ChunkedArray, buffer: np.ndarray) -> pa.ChunkedArray:
    """``column`` (one image a row) with each image followed by zeros to ROW_BYTES, held in ``buffer``, in the
    column's own type as Arrow holds that many bytes: binary's int32 offsets need chunks under 2 GiB each (as
    pa.array cuts a longer list), large_binary's int64 offsets take one. Only the images' pages are written."""
    images = [row[0] for row in column.to_pylist()]
    value = column.type.value_type
    large = value == pa.large_binary()
    per_chunk = len(images) if large else (2**31 - 1) // ROW_BYTES
    for i, image in enumerate(images):
        buffer[i * ROW_BYTES : i * ROW_BYTES + len(image)] = np.frombuffer(image, np.uint8)
    chunks = []
    for a in range(0, len(images), per_chunk):
        n = min(per_chunk, len(images) - a)
        offsets = pa.py_buffer((np.arange(n + 1) * ROW_BYTES).astype(np.int64 if large else np.int32))
        values = pa.py_buffer(buffer[a * ROW_BYTES : (a + n) * ROW_BYTES])
        binary = pa.Array.from_buffers(value, n, [None, offsets, values])
        chunks.append(pa.ListArray.from_arrays(pa.array(np.arange(n + 1), pa.int32()), binary))
    return pa.chunked_array(chunks, column.type)


def refuse_pickle(table: InMemoryTable) -> object:
    """InMemoryTable's pickling, refused for a table holding image bytes (large_binary: the tokenizing map's
    input): datasets' default fingerprint hashes a pickle of the whole table (a copy of every byte, several at
    once). The rows' references (list<binary>, 32 bytes an image) may be."""
    holds = [f.name for f in table.schema if "large_binary" in str(f.type)]
    assert not holds, f"a table of image bytes was pickled ({holds}: datasets hashes it by default)"
    return object.__getstate__(table)


def test_a_split_past_2_gib_of_image_bytes_prepares(split, tmp_path: Path, monkeypatch) -> None:
    """The real tokenized table, its image column grown past 2 GiB: before large_binary and the zero-copy row
    selection, build_split's take raised "offset overflow while concatenating arrays"; the rows are not
    pickled for their fingerprint (datasets' default: over 20 GiB of memory for these 2.1); the split's images
    are the encoded table's bytes, not a copy."""
    _, records, _ = split
    buffer = np.zeros(len(records) * ROW_BYTES, np.uint8)  # calloc: untouched pages cost no memory
    encode = tables._encode

    def grown(*args, **kwargs) -> pa.Table:
        table = encode(*args, **kwargs)
        # from here on a pickle of the rows fails fast, not > 20 GiB into an OOM
        monkeypatch.setattr(InMemoryTable, "__getstate__", refuse_pickle)
        at = table.column_names.index("image_bytes")
        return table.set_column(at, "image_bytes", past_2_gib(table.column("image_bytes"), buffer))

    monkeypatch.setattr(tables, "_encode", grown)
    built = build(split, tmp_path)
    ds, images = built.rows, built.images
    assert ds.features["images"] == datasets.List(datasets.Value("binary"))  # references
    assert len(ds) == 7 and images.num_rows == 7 and 7 * ROW_BYTES > 2**31  # the kept images pass the limit
    column = images.column("bytes")
    for i, source in enumerate(ds["source"]):
        k = int(source.rsplit(":", 1)[1]) - 1
        image = records[k].images[0]
        (ref,) = ds[i]["images"]
        assert k != LONG and images.column("digest")[i].as_py() == ref  # distinct images, in first-use order
        chunk, at = _locate(column, i)
        _, offsets, data = chunk.buffers()
        start, end = np.frombuffer(offsets, np.int64)[chunk.offset + at : chunk.offset + at + 2].tolist()
        assert end - start == ROW_BYTES and data.slice(start, len(image)).to_pybytes() == image
        assert ref == hashlib.sha256(memoryview(data)[start:end]).digest()
        # the encoded table's bytes, not a copy: one copy of a split's images is held
        assert data.address + start == buffer.ctypes.data + k * ROW_BYTES


def _locate(column: pa.ChunkedArray, i: int) -> tuple[pa.Array, int]:
    """(the chunk of ``column`` holding value ``i``, its index there)."""
    for chunk in column.chunks:
        if i < len(chunk):
            return chunk, i
        i -= len(chunk)
    raise IndexError(i)


def test_the_stored_images_are_the_records_bytes(split, tmp_path: Path, monkeypatch) -> None:
    """Saved and loaded (as coati_kto.data.store does), a row's images resolve to its record's bytes and collate
    to the processor's pixels. No table of image bytes is pickled on the way (the tokenizing map's input
    included)."""
    _, records, _ = split
    with monkeypatch.context() as patched:
        patched.setattr(InMemoryTable, "__getstate__", refuse_pickle)
        built = build(split, tmp_path / "work")
    built.save_to_disk(str(tmp_path / "saved" / "train"))
    loaded = datasets.load_from_disk(str(tmp_path / "saved" / "train"))
    table = open_images(tmp_path / "saved")
    assert loaded.to_list() == built.rows.to_list() and len(table) == 7
    for row in loaded:
        assert table.row_images(row) == records[int(row["source"].rsplit(":", 1)[1]) - 1].images
    processor = gemma3_processor()
    collate = KTOCollator(
        0,
        image_processor=processor.image_processor,
        image_token_id=SOFT,
        image_seq_length=4,
        image_table=table,
    )
    batch = collate([loaded[i] for i in range(4)])
    own = processor.image_processor(
        images=[Image.open(io.BytesIO(table.row_images(loaded[i])[0])) for i in range(4)], return_tensors="pt"
    )
    assert batch.images.pixel_values.shape == (4, 3, 28, 28)
    assert torch.equal(batch.images.pixel_values, own["pixel_values"])
    assert batch.images.image_rows.tolist() == [0, 1, 2, 3]
