"""Image records that failed outside the record checks (each was a traceback): an image file the process cannot
read, an image PIL opens but the processor refuses, and Gemma 3's pan-and-scan crops, which the ids prepare stored
do not hold. A bad record is one line in ``data.on_bad_record: error`` and skipped, counted by reason, with
``skip``; a processor setting is refused in one line before any batch."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image
from test_image_store import SOFT, image_rows, png, settings, vl_model_dir

from coati_kto.config.schema import ModelSection
from coati_kto.data import store
from coati_kto.data.collator import KTOCollator
from coati_kto.data.files import write_jsonl
from coati_kto.data.formats import RecordError
from coati_kto.data.image_store import collator_images
from coati_kto.data.prepared import prepare
from coati_kto.errors import ConfigError
from coati_kto.testing.image_rows import stored
from coati_kto.testing.tiny_processors import gemma3_processor, write_vl


@pytest.fixture
def unreadable(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """File names whose read fails with EACCES (what a non-root user gets from another user's mode-600 image;
    root reads any mode). Empty the set to "fix" them."""
    names = {"green.png"}
    read = Path.read_bytes

    def denied(self: Path) -> bytes:
        if self.name in names:
            raise PermissionError(13, "Permission denied")
        return read(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    return names


def test_an_unreadable_image_is_one_line(tmp_path: Path, unreadable: set[str]) -> None:
    data = image_rows(tmp_path)
    with pytest.raises(RecordError) as err:
        prepare(*settings(tmp_path, vl_model_dir(tmp_path), data))
    assert (str(err.value), err.value.reason) == (
        f"{data}:2: field 'images[0]': cannot read image file {tmp_path / 'green.png'} (Permission denied)",
        "unreadable_image",
    )


def test_an_image_in_a_folder_the_process_cannot_search_is_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder without search permission fails the file's stat with EACCES (``is_file`` raises it): that is
    the image being unreadable, not a malformed path (it was reported ``bad_image``, "not a usable path")."""
    data = image_rows(tmp_path)
    is_file = Path.is_file

    def denied(self: Path) -> bool:
        if self.name == "green.png":
            raise PermissionError(13, "Permission denied")
        return is_file(self)

    monkeypatch.setattr(Path, "is_file", denied)
    with pytest.raises(RecordError) as err:
        prepare(*settings(tmp_path, vl_model_dir(tmp_path), data))
    assert (str(err.value), err.value.reason) == (
        f"{data}:2: field 'images[0]': cannot read image file {tmp_path / 'green.png'} (Permission denied)",
        "unreadable_image",
    )


def test_an_unreadable_image_is_skipped_and_a_fixed_one_rebuilds(
    tmp_path: Path, unreadable: set[str]
) -> None:
    """The fingerprint reads the images first: it skips the record as the build does. Fixed, the record's
    image enters the images digest, so the next prepare rebuilds with it."""
    model, data = vl_model_dir(tmp_path), image_rows(tmp_path)
    out = prepare(*settings(tmp_path, model, data, on_bad_record="skip"))
    assert len(out.train) == 6  # records 2 and 6 name green.png
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["unreadable_image"] * 2
    before = store.read_fingerprint(tmp_path / "prepared")
    unreadable.clear()
    prep, _ = settings(tmp_path, model, data, on_bad_record="skip")
    after = store.fingerprint(prep, gemma3_processor().tokenizer, store.load_processor(prep))
    assert store._changed(before, after) == "images"
    assert len(prepare(*settings(tmp_path, model, data, on_bad_record="skip")).train) == 8


def wide_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


def qwen_rows(root: Path) -> Path:
    """4 records about one image each: record 3's is 250 x 1 pixels, which PIL opens and Qwen's image processor
    refuses (its aspect ratio is over 200)."""
    rows = []
    for i in range(4):
        name = f"{i}.png"
        (root / name).write_bytes(wide_png(250, 1) if i == 2 else wide_png(32, 32))
        ask = [{"type": "image"}, {"type": "text", "text": f"What colour is it? ({i})"}]
        rows.append(
            {
                "prompt": [{"role": "user", "content": ask}],
                "completion": [{"role": "assistant", "content": "red"}],
                "label": i % 2 == 0,
                "images": [name],
            }
        )
    return write_jsonl(rows, root / "train.jsonl")


def test_an_image_the_processor_refuses_is_a_bad_image_record(tmp_path: Path) -> None:
    model, data = write_vl(tmp_path / "qwen", "qwen3_5_vl"), qwen_rows(tmp_path)
    with pytest.raises(RecordError) as err:
        prepare(*settings(tmp_path, model, data))
    assert (str(err.value), err.value.reason) == (
        f"{data}:3: field 'images': the processor refused the image(s): absolute aspect ratio must be smaller "
        "than 200, got 250.0",
        "bad_image",
    )
    out = prepare(*settings(tmp_path, model, data, on_bad_record="skip"))
    assert [s.rsplit(":", 1)[1] for s in sorted(out.train["source"])] == ["1", "2", "4"]
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["bad_image"]


def pan_and_scan_model(root: Path) -> Path:
    """The tiny Gemma 3 VL folder with ``do_pan_and_scan: true`` in its processor's image processor config."""
    model = vl_model_dir(root)
    config = json.loads((model / "processor_config.json").read_text())
    config["image_processor"].update(
        do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_min_ratio_to_activate=1.2
    )
    (model / "processor_config.json").write_text(json.dumps(config))
    return model


PAN_AND_SCAN = (
    "its image processor's config sets do_pan_and_scan true: image records take one image per image part, no "
    "pan-and-scan crops; set do_pan_and_scan to false"
)


def test_pan_and_scan_is_refused_at_prepare_and_before_training(tmp_path: Path) -> None:
    """Prepare expanded one image run per image (the processor's own default turns the crops off) and the
    collator's image processor cropped: step 1 raised "Image features and image tokens do not match"."""
    model = pan_and_scan_model(tmp_path)
    with pytest.raises(ConfigError) as err:
        collator_images(ModelSection(path=str(model)))
    assert str(err.value) == f"model.path {model}: {PAN_AND_SCAN}"
    with pytest.raises(ConfigError) as err:
        prepare(*settings(tmp_path, model, image_rows(tmp_path)))
    assert str(err.value) == f"model.path {model}: {PAN_AND_SCAN}"


def test_the_collator_takes_one_pixel_input_per_image(tmp_path: Path) -> None:
    """An image processor that crops (pixel values for 4 images from 2): one line, not a mismatch in the
    forward."""
    processor = gemma3_processor()
    image_processor = processor.image_processor
    image_processor.do_pan_and_scan, image_processor.pan_and_scan_min_crop_size = True, 8
    image_processor.pan_and_scan_max_num_crops, image_processor.pan_and_scan_min_ratio_to_activate = 4, 1.2
    wide = wide_png(120, 40)
    ids = [2, *([SOFT] * 4), 7, 8]
    row = dict(
        input_ids=ids, completion_start=6, label=True, kl_input_ids=ids, kl_completion_start=6, images=[wide]
    )
    rows, table = stored([row, dict(row, label=False), dict(row, label=False, images=[png((0, 0, 255))])])
    collate = KTOCollator(
        0,
        image_processor=processor.image_processor,
        image_token_id=SOFT,
        image_seq_length=4,
        image_table=table,
    )
    with pytest.raises(ValueError) as err:
        collate(rows[:2])
    assert str(err.value) == (
        "the image processor gave 8 images for the batch's 2: image records take one per image (set "
        "do_pan_and_scan to false in the image processor's config)"
    )
    processor.image_processor.do_pan_and_scan = False
    assert collate([rows[0], rows[2]]).images.pixel_values.shape[0] == 2
