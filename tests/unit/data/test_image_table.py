"""An image shared by many records is stored once per split (coati_kto.data.image_table): the prepared folder grows
with the distinct images, not the rows, and the collator gives the processor the bytes the per-row layout gave,
in the same order (the same pixel values: training is unchanged). Before, each row held its image's bytes: 8
records sharing one image stored it 8 times."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image
from test_image_store import COLOURS, gemma3_collator, settings, vl_model_dir
from test_text_builds_kept import as_version_8_wrote_it

from coati_kto.config.resume import check_training_data
from coati_kto.data import store
from coati_kto.data.files import write_jsonl
from coati_kto.data.image_refs import digest
from coati_kto.data.images import open_image
from coati_kto.data.prepared import prepare
from coati_kto.data.prepared_read import read_prepared
from coati_kto.data.tokenize import load_tokenizer
from coati_kto.data.train_data import train_data_digest, train_data_parts


def noise_png(seed: int, side: int = 160) -> bytes:
    """A PNG that does not compress (random pixels): ``side``² x 3 bytes, about 77 KB at 160."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """12 records: 9 share one large image, 3 share a small one (a colour), labels alternating; prepared."""
    root = tmp_path_factory.mktemp("shared-images")
    model = vl_model_dir(root)
    (root / "big.png").write_bytes(noise_png(0))
    (root / "red.png").write_bytes(_png_red())
    rows = [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"What? ({i})"}]}
            ],
            "completion": [{"role": "assistant", "content": "red" if i % 2 == 0 else "blue"}],
            "label": i % 2 == 0,
            "images": ["red.png" if i % 4 == 3 else "big.png"],
        }
        for i in range(12)
    ]
    data = write_jsonl(rows, root / "train.jsonl")
    return root, model, data, prepare(*settings(root, model, data))


def _png_red() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), COLOURS["red"]).save(buf, "PNG")
    return buf.getvalue()


def test_a_shared_image_is_stored_once(shared) -> None:
    """The split's images file holds each distinct image once; the rows hold 32-byte references; the folder is
    about the distinct images' size, where the per-row layout held the big image 9 times."""
    root, _, _, out = shared
    big, red = (root / "big.png").read_bytes(), (root / "red.png").read_bytes()
    prepared = root / "prepared"
    size = sum(f.stat().st_size for f in prepared.rglob("*") if f.is_file())
    assert size < len(big) + len(red) + 100_000, f"{size} bytes for {len(big)} + {len(red)} of images"
    table = pa.ipc.open_file(pa.memory_map(str(prepared / "train" / "images.arrow"))).read_all()
    assert table.column("bytes").to_pylist() == [big, red]  # first use: record 1 holds big.png
    assert table.column("digest").to_pylist() == [digest(big), digest(red)]
    assert len(out.train) == 12 and len(out.images) == 2
    for row in out.train:
        line = int(row["source"].rsplit(":", 1)[1])
        want = red if (line - 1) % 4 == 3 else big
        assert row["images"] == [digest(want)]  # a reference, not the bytes
        assert out.images.row_images(row) == [want]


def test_the_batch_is_the_per_row_layouts(shared) -> None:
    """A training batch's pixel values, image rows and token types equal those of the processor over the rows'
    images in row order: what the per-row layout's collator gave."""
    root, _, _, out = shared
    processor, collate = gemma3_collator(out)
    rows = [out.train[i] for i in (0, 3, 1, 7, 4)]
    batch = collate(rows)
    files = ["red.png" if (int(r["source"].rsplit(":", 1)[1]) - 1) % 4 == 3 else "big.png" for r in rows]
    own = processor.image_processor(
        images=[open_image((root / f).read_bytes()) for f in files], return_tensors="pt"
    )
    assert torch.equal(batch.images.pixel_values, own["pixel_values"])
    assert batch.images.image_rows.tolist() == [0, 1, 2, 3, 4]
    assert batch.images.example_token_types.sum(1).tolist() == [4] * 5


def test_opening_maps_the_images_and_pickles_as_a_path(shared) -> None:
    """Opening a build reads no image into memory (the file is memory-mapped, as the rows are); a DataLoader
    worker gets the path, not the bytes."""
    root, _, _, out = shared
    before = pa.total_allocated_bytes()
    opened = read_prepared(root / "prepared")
    big = (root / "big.png").read_bytes()
    assert opened.images.row_images(opened.train[0]) == [big]
    assert pa.total_allocated_bytes() - before < len(big) // 4
    assert len(pickle.dumps(opened.images)) < 2_000
    again = pickle.loads(pickle.dumps(opened.images))
    assert again.row_images(opened.train[0]) == [big]


def test_a_missing_images_file_or_an_older_build_is_built_again(shared, tmp_path: Path) -> None:
    """A build whose images file is gone is damaged (built again); a build of the per-row layout (version 8's
    fingerprint, no image_layout) is another layout: built again, not read with bytes where references are
    expected. A resume across it goes on: the rebuilt rows are the same (train_data unchanged)."""
    root, model, data, _ = shared
    prepare_settings, _ = settings(root, model, data)
    tokenizer = load_tokenizer(prepare_settings.model)
    prepared = root / "prepared"
    moved = tmp_path / "images.arrow"
    (prepared / "train" / "images.arrow").rename(moved)
    try:
        assert store.build_reason(prepare_settings, tokenizer) == "damaged: train/images.arrow is missing"
    finally:
        moved.rename(prepared / "train" / "images.arrow")
    assert store.build_reason(prepare_settings, tokenizer) is None
    saved = (prepared / "fingerprint.json").read_text()
    current = json.loads(saved)
    assert current["version"] == 8 and current["image_layout"] == store.IMAGE_LAYOUT == 2
    old = as_version_8_wrote_it({k: v for k, v in current.items() if k != "image_layout"})
    (prepared / "fingerprint.json").write_text(json.dumps(old))
    try:
        assert store.build_reason(prepare_settings, tokenizer) == "changed: image_layout"
    finally:
        (prepared / "fingerprint.json").write_text(saved)
    assert train_data_digest(old) == train_data_digest(current)
    parts = (train_data_parts(old), train_data_parts(current))
    check_training_data(train_data_digest(old), train_data_digest(current), "ckpt", parts)
