"""An image many records share (several completions rated per image) is decoded and run through the processor
once per prepare, not once per record: 200 records sharing 4 PNGs of 1-4 MB decoded 1000 times (a check, then
the processor's copy) and called the processor 200 times. A bad shared image is still one bad record per record
holding it, each named (file:line, field) and counted."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image
from test_image_failures import wide_png
from test_image_store import COLOURS, SOFT, png, settings, vl_model_dir
from transformers import Gemma3Processor

from coati_kto.data.files import write_jsonl
from coati_kto.data.formats import RecordError
from coati_kto.data.images import ImageExpander
from coati_kto.data.prepared import prepare
from coati_kto.testing.tiny_processors import qwen3_5_processor


def shared_rows(root: Path, names: list[str]) -> Path:
    """One record per name in ``names`` (its image file), labels alternating."""
    rows = [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour? ({i})"}]}
            ],
            "completion": [{"role": "assistant", "content": ["red", "blue", "green"][i % 3]}],
            "label": i % 2 == 0,
            "images": [name],
        }
        for i, name in enumerate(names)
    ]
    return write_jsonl(rows, root / "train.jsonl")


def counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of PIL opens (each is a decode here: the check's and the processor's copy) and processor calls."""
    counts = {"opens": 0, "processor": 0}
    opened, called = Image.open, Gemma3Processor.__call__

    def open_(*args, **kwargs):
        counts["opens"] += 1
        return opened(*args, **kwargs)

    def call(self, *args, **kwargs):
        counts["processor"] += 1
        return called(self, *args, **kwargs)

    monkeypatch.setattr(Image, "open", open_)
    monkeypatch.setattr(Gemma3Processor, "__call__", call)
    return counts


def test_a_shared_image_is_decoded_and_processed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 records over 2 images: 2 decodes each (the check, the processor's RGB copy) and 2 processor calls,
    where each record decoded its image twice (24) and called the processor (12); the rows are unchanged: each
    prompt holds its image's 4 soft tokens."""
    (tmp_path / "red.png").write_bytes(png(COLOURS["red"]))
    (tmp_path / "blue.png").write_bytes(png(COLOURS["blue"]))
    model = vl_model_dir(tmp_path)
    data = shared_rows(tmp_path, ["red.png" if i % 3 else "blue.png" for i in range(12)])
    counts = counting(monkeypatch)
    out = prepare(*settings(tmp_path, model, data))
    assert counts == {"opens": 4, "processor": 2}
    assert len(out.train) == 12
    assert [sum(t == SOFT for t in row["input_ids"]) for row in out.train] == [4] * 12


def test_a_bad_shared_image_names_every_record_holding_it(tmp_path: Path) -> None:
    """A truncated image on lines 2, 3 and 6 of 8: decoded once, and each of the three is its own bad record, named
    and counted (skip), the first raised (error)."""
    (tmp_path / "red.png").write_bytes(png(COLOURS["red"]))
    (tmp_path / "bad.png").write_bytes(png(COLOURS["blue"])[:40])
    model = vl_model_dir(tmp_path)
    data = shared_rows(tmp_path, ["bad.png" if i in (1, 2, 5) else "red.png" for i in range(8)])
    out = prepare(*settings(tmp_path, model, data, on_bad_record="skip"))
    assert [s.rsplit(":", 1)[1] for s in out.train["source"]] == ["1", "4", "5", "7", "8"]
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    problem = "field 'images[0]': not an image PIL can open (40 bytes: no image format PIL knows)"
    assert [line.split("\t")[0] for line in lines] == ["bad_image"] * 3
    assert sorted(line.split("\t")[1] for line in lines) == [f"{data}:{n}: {problem}" for n in (2, 3, 6)]
    with pytest.raises(RecordError, match=f"^{data}:2: field 'images\\[0\\]': not an image PIL can open"):
        prepare(*settings(tmp_path, model, data))


def test_an_image_the_processor_refuses_is_refused_for_each_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen refuses a 250 x 1 image (aspect ratio over 200): asked once, and each of the three rows holding it is
    a bad_image record with the processor's line; the fine rows expand to their image's run."""
    processor = qwen3_5_processor()
    expander, calls = ImageExpander(processor), []
    called = type(processor).__call__
    monkeypatch.setattr(
        type(processor), "__call__", lambda self, *a, **k: calls.append(1) or called(self, *a, **k)
    )
    wide, square = wide_png(250, 1), wide_png(32, 32)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>What?"
    images = [[wide], [square], [wide], [wide], [square]]
    out = expander.expand_rows([(prompt, "red")] * 5, images, [f"d.jsonl:{i + 1}" for i in range(5)])
    assert len(calls) == 2
    refused = "the processor refused the image(s): absolute aspect ratio must be smaller than 200, got 250.0"
    assert [str(o) for o in out if isinstance(o, RecordError)] == [
        f"d.jsonl:{n}: field 'images': {refused}" for n in (1, 3, 4)
    ]
    run = "<|image_pad|>" * 4  # a 32 x 32 image: 4 tokens
    assert out[1] == out[4] == (f"<|vision_start|>{run}<|vision_end|>What?", "red")
