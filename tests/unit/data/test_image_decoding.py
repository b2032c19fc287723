"""How an image's bytes become the picture the model sees (from a read-and-run audit of image records).

Before: ``open_image`` kept the raw decode. A phone photo's EXIF orientation was ignored (transformers'
``load_image``, datasets' Image and every viewer turn it upright); a grayscale, palette or transparent image
reached the collator's bare image-processor call unconverted, which a Hub config's ``"do_convert_rgb": null``
(Gemma 3's) leaves off: it prepared through the processor, then failed the training step's collate; a 16-bit PNG
was clipped to white by the processors without a word. Now the image is upright and RGB (transparency composited
onto white, as transformers' ``convert_to_rgb``), and a wider-than-8-bit image is a one-line bad record.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_image_store import settings, vl_model_dir
from transformers.image_utils import load_image

from coati_kto.data.collator import KTOCollator
from coati_kto.data.files import write_jsonl
from coati_kto.data.formats import RecordError
from coati_kto.data.image_refs import check_decodes
from coati_kto.data.image_store import collator_images
from coati_kto.data.images import open_image
from coati_kto.data.prepared import prepare


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_a_photo_is_turned_upright_by_its_exif_orientation(tmp_path: Path) -> None:
    photo = Image.new("RGB", (64, 32), (255, 0, 0))
    photo.paste((0, 0, 255), (32, 0, 64, 32))  # left half red, right half blue, as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    path = tmp_path / "photo.jpg"
    photo.save(path, "JPEG", exif=exif, quality=95)
    seen = open_image(path.read_bytes())
    assert seen.size == load_image(str(path)).size == (32, 64)  # before: (64, 32), the raw pixels
    assert np.abs(np.asarray(seen, float) - np.asarray(load_image(str(path)), float)).max() == 0


def test_every_mode_comes_out_rgb_with_transparency_on_white() -> None:
    palette = Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 30, 40] + [0] * 762)
    clear_palette = palette.copy()
    clear_palette.info["transparency"] = 1
    cases = {
        "L": (Image.new("L", (4, 4), 77), (77, 77, 77)),
        "P": (palette, (200, 30, 40)),
        "P, transparent": (clear_palette, (255, 255, 255)),
        "RGBA, clear red": (Image.new("RGBA", (4, 4), (255, 0, 0, 0)), (255, 255, 255)),
        "LA, half grey": (Image.new("LA", (4, 4), (0, 128)), (127, 127, 127)),
        "1": (Image.new("1", (4, 4), 1), (255, 255, 255)),
    }
    for name, (image, pixel) in cases.items():
        seen = open_image(_png(image))
        assert seen.mode == "RGB" and seen.getpixel((0, 0)) == pixel, name


@pytest.mark.parametrize("mode", ["I;16", "I", "F"])
def test_an_image_wider_than_8_bits_is_a_bad_record(mode: str, tmp_path: Path) -> None:
    image = Image.new(mode, (4, 4), 32768 if mode != "F" else 0.5)
    path = tmp_path / "wide.tiff"
    image.save(path, "TIFF")
    with pytest.raises(RecordError) as info:
        check_decodes(path.read_bytes(), "d.jsonl:3", "images[0]")
    assert info.value.reason == "bad_image" and "convert it to 8-bit" in str(info.value)
    assert str(info.value).startswith("d.jsonl:3: field 'images[0]': a ")
    check_decodes(_png(Image.new("L", (4, 4), 9)), "d.jsonl:3", "images[0]")  # 8 bits: fine


@pytest.mark.parametrize("kind", ["GIF", "PNG", "WEBP", "TIFF"])
def test_an_image_of_several_frames_is_a_bad_record(kind: str) -> None:
    """An animated GIF, PNG or WebP (or a multi-page TIFF) was prepared and trained as its first frame, without a
    word: a record labelled for what the animation shows."""
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, kind, save_all=True, append_images=frames[1:])
    with pytest.raises(RecordError) as info:
        check_decodes(out.getvalue(), "d.jsonl:3", "images[0]")
    assert info.value.reason == "bad_image"
    assert str(info.value).startswith(
        "d.jsonl:3: field 'images[0]': an image of 2 frames (an animation or a multi"
    )
    still = io.BytesIO()
    frames[0].save(still, kind, save_all=True)  # one frame, written as an animation file: fine
    check_decodes(still.getvalue(), "d.jsonl:3", "images[0]")


def test_a_camera_jpeg_with_a_preview_is_one_picture() -> None:
    """A JPEG carrying an MPF secondary image (a camera's preview, a phone's depth map) opens in Pillow as MPO of 2
    frames; its first is the photo, which trained before the frames check and must still."""
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "MPO", save_all=True, append_images=frames[1:])
    with Image.open(io.BytesIO(out.getvalue())) as opened:
        assert (opened.format, opened.n_frames) == ("MPO", 2)
    check_decodes(out.getvalue(), "d.jsonl:3", "images[0]")


def test_a_hub_configs_null_conversion_no_longer_fails_the_collate(tmp_path: Path) -> None:
    """Gemma 3's Hub preprocessor_config.json holds ``"do_convert_rgb": null`` (the processor call supplies True,
    the bare image processor does not): a grayscale row prepared, then raised "mean must have 1 elements"."""
    model = vl_model_dir(tmp_path)
    config = json.loads((model / "processor_config.json").read_text())
    image_config = config.pop("image_processor")
    image_config.update({"do_convert_rgb": None, "processor_class": "Gemma3Processor"})
    (model / "processor_config.json").write_text(json.dumps(config))
    (model / "preprocessor_config.json").write_text(json.dumps(image_config))
    images = {"grey.png": Image.new("L", (32, 32), 77), "rgb.png": Image.new("RGB", (32, 32), (77, 77, 77))}
    for name, image in images.items():
        (tmp_path / name).write_bytes(_png(image))
    rows = [
        {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"colour? {i}"}]}],
         "completion": [{"role": "assistant", "content": "grey"}], "label": i % 2 == 0,
         "images": ["grey.png" if i % 2 else "rgb.png"]}
        for i in range(4)
    ]  # fmt: skip
    prepare_settings, weights = settings(tmp_path, model, write_jsonl(rows, tmp_path / "train.jsonl"))
    out = prepare(prepare_settings, weights)
    kwargs = collator_images(prepare_settings.model)
    assert kwargs["image_processor"].do_convert_rgb is None  # the Hub's null reached the collator
    collate = KTOCollator(0, **kwargs, image_table=out.images)
    pixels = [collate([out.train[i]]).images.pixel_values for i in range(len(out.train))]
    assert all(np.array_equal(p.numpy(), pixels[0].numpy()) for p in pixels)  # grey L = grey RGB


def test_a_typed_image_token_in_text_records_for_a_vision_language_model_is_a_bad_record(
    tmp_path: Path,
) -> None:
    """A text-only build for a vision-language model runs no processor, so the check that refuses a typed image
    token ran only when some record had an image: ``<image_soft_token>`` written in a record trained as an image
    token no image fills. Now the same one-line bad record, image records or not."""
    model = vl_model_dir(tmp_path)
    soft = "<image_soft_token>"
    rows = [
        {"prompt": [{"role": "user", "content": f"colour? {i}" + (soft if i == 2 else "")}],
         "completion": [{"role": "assistant", "content": "grey"}], "label": i % 2 == 0}
        for i in range(6)
    ]  # fmt: skip
    data = write_jsonl(rows, tmp_path / "train.jsonl")
    with pytest.raises(
        RecordError, match=rf"train.jsonl:3: field 'messages': the record holds the image token '{soft}'"
    ):
        prepare(*settings(tmp_path, model, data))
    out = prepare(*settings(tmp_path, model, data, on_bad_record="skip"))
    assert len(out.train) == 5 and out.stats["bad_records"]["by_reason"] == {"image_placeholders": 1}
