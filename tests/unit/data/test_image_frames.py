"""An image of several frames is a bad record in every format Pillow reads as one, from the data file on.

Before: the frames check named GIF, PNG, WebP and TIFF; an animated AVIF (Pillow reads AVIF since 11.2, its
n_frames as GIF's) passed, and was prepared and trained as its first frame without a word."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image, features

from coati_kto.data.files import load_records
from coati_kto.data.formats import RecordError
from coati_kto.data.image_refs import check_decodes

RED, BLUE = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))


def _saved(kind: str, frames: list[Image.Image]) -> bytes:
    out = io.BytesIO()
    frames[0].save(out, kind, save_all=True, append_images=frames[1:])
    return out.getvalue()


@pytest.mark.skipif(not features.check("avif"), reason="this Pillow reads no AVIF")
def test_an_animated_avif_is_a_bad_record() -> None:
    with Image.open(io.BytesIO(_saved("AVIF", [RED, BLUE]))) as opened:
        assert (opened.format, opened.n_frames) == ("AVIF", 2)  # Pillow itself shows the first frame alone
    with pytest.raises(RecordError) as info:
        check_decodes(_saved("AVIF", [RED, BLUE]), "d.jsonl:3", "images[0]")
    assert info.value.reason == "bad_image"
    assert str(info.value).startswith("d.jsonl:3: field 'images[0]': an image of 2 frames (an animation")
    check_decodes(_saved("AVIF", [RED]), "d.jsonl:3", "images[0]")  # a still AVIF: fine


def test_a_record_whose_image_is_an_animated_gif_is_skipped_and_counted(tmp_path: Path) -> None:
    """The whole path from a JSONL line: the record naming a 2-frame GIF is one line (file:line, field), or
    skipped and counted under bad_image (prepare's summary: ``bad records skipped: 1 (bad_image 1; ...)``)."""
    (tmp_path / "moving.gif").write_bytes(_saved("GIF", [RED, BLUE]))
    (tmp_path / "still.gif").write_bytes(_saved("GIF", [RED]))
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": [
                        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}
                    ],
                    "completion": [{"role": "assistant", "content": "red"}],
                    "label": True,
                    "images": [name],
                }
            )
            + "\n"
            for name in ("still.gif", "moving.gif")
        )
    )
    with pytest.raises(RecordError, match=f"^{path}:2: field 'images\\[0\\]': an image of 2 frames"):
        load_records([str(path)], images=True)
    kept = load_records([str(path)], on_bad_record="skip", images=True)
    assert [r.images for r in kept.records] == [[(tmp_path / "still.gif").read_bytes()]]
    assert [(b.source, b.reason) for b in kept.skipped] == [(f"{path}:2", "bad_image")]
