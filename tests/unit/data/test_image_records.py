"""Image records (TRL's vision-language format, issue 49 step 2): the ``images`` field and content parts, read
only when asked (``load_records(images=True)``); refused by default, as prepare and train still do."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import datasets
import pytest
from PIL import Image

from coati_kto.data.files import load_records, write_jsonl
from coati_kto.data.unread import unread_fields
from coati_kto.errors import DataError

ASK = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


def record(images: list, prompt_content: list | None = None, completion: object = "red") -> dict:
    return {
        "prompt": [{"role": "user", "content": ASK if prompt_content is None else prompt_content}],
        "completion": [{"role": "assistant", "content": completion}],
        "label": True,
        "images": images,
    }


def test_relative_paths_resolve_from_the_data_file(tmp_path: Path) -> None:
    (tmp_path / "data" / "img").mkdir(parents=True)
    red = png((255, 0, 0))
    (tmp_path / "data" / "img" / "red.png").write_bytes(red)
    path = write_jsonl([record(["img/red.png"])], tmp_path / "data" / "train.jsonl")
    result = load_records([str(path)], images=True)
    (only,) = result.records
    assert only.images == [red]
    assert only.prompt == [{"role": "user", "content": ASK}]
    assert only.completion == [{"role": "assistant", "content": "red"}]
    assert result.unread_fields == {}  # read, so not reported as unread
    assert unread_fields(record([]), images=False) == {"images"}


def test_parquet_image_structs(tmp_path: Path) -> None:
    """datasets' Image feature stores {"bytes", "path"} structs; rows come back undecoded, as bytes."""
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    two = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Same colour?"}]
    features = datasets.Features(
        {
            "prompt": datasets.List(
                {
                    "role": datasets.Value("string"),
                    "content": datasets.List(
                        {"type": datasets.Value("string"), "text": datasets.Value("string")}
                    ),
                }
            ),
            "completion": datasets.Value("string"),
            "label": datasets.Value("bool"),
            "images": datasets.List(datasets.Image()),
        }
    )
    rows = {
        "prompt": [[{"role": "user", "content": two}]],
        "completion": ["no"],
        "label": [False],
        "images": [[{"bytes": red, "path": None}, {"bytes": blue, "path": None}]],
    }
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    with pytest.raises(DataError) as info:  # a plain-string completion beside a message prompt
        load_records([str(path)], images=True)
    assert str(info.value) == (
        f"{path}:row 1: field 'completion': prompt and completion must both be strings or messages (prompt is "
        "list, completion is str)"
    )
    rows["completion"] = [[{"role": "assistant", "content": [{"type": "text", "text": "no"}]}]]
    features["completion"] = features["prompt"]
    datasets.Dataset.from_dict(rows, features=features).to_parquet(str(path))
    (only,) = load_records([str(path)], images=True).records
    assert only.images == [red, blue]
    assert only.prompt[0]["content"] == two  # the table's null "text" of image parts dropped
    assert only.completion == [{"role": "assistant", "content": "no"}]  # text parts joined into one string


def test_a_preference_pair_shares_its_images(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(red := png((255, 0, 0)))
    pair = {
        "prompt": [{"role": "user", "content": ASK}],
        "chosen": [{"role": "assistant", "content": "red"}],
        "rejected": [{"role": "assistant", "content": "green"}],
        "images": ["a.png"],
    }
    records = load_records([str(write_jsonl([pair], tmp_path / "p.jsonl"))], images=True).records
    assert [(r.label, r.images) for r in records] == [(True, [red]), (False, [red])]


def bomb_png(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width`` x ``height`` pixels (PIL refuses it on opening, before any pixel)."""
    data = png((0, 0, 0))
    header = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + header + struct.pack(">I", zlib.crc32(header)) + data[33:]


def bad_cases(tmp_path: Path) -> list[tuple[dict, str, str]]:
    good = png((0, 255, 0))
    (tmp_path / "truncated.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "text.png").write_bytes(b"not an image")
    bomb = (tmp_path / "bomb.png").write_bytes(bomb_png(20000, 20000))
    base64 = "iVBORw0KGgo" + "A" * 400
    return [
        (  # PIL's DecompressionBombError is no OSError: it was a traceback
            record(["bomb.png"]),
            f"field 'images[0]': not an image PIL can open ({bomb} bytes: Image size (400000000 pixels) exceeds limit "
            "of 178956970 pixels, could be decompression bomb DOS attack.)",
            "bad_image",
        ),
        (  # a name longer than the file system takes: OSError from is_file, a traceback
            record([base64]),
            f"field 'images[0]': \"{base64[:56]}... is not a usable path (File name too long)",
            "bad_image",
        ),
        (  # a data URI was looked for as a file under the data's folder, and shown whole
            record([f"data:image/png;base64,{base64}"]),
            "field 'images[0]': \"data:image/png;base64,iVBORw0KGgoAAAAAAAAAAAAAAAAAAAAAAA... is not read: "
            "image references are files (a path), bytes or a {'bytes', 'path'} struct; save it to a file and "
            "give its path",
            "bad_image",
        ),
        (
            record(["a.png", "b.png"]),
            "field 'images': 2 image(s) for 1 image part(s) in the prompt: each "
            "{'type': 'image'} part takes the next image, in order",
            "image_count",
        ),
        (
            record([], prompt_content=ASK),
            "field 'images': 0 image(s) for 1 image part(s) in the prompt: each "
            "{'type': 'image'} part takes the next image, in order",
            "image_count",
        ),
        (
            record(["missing.png"]),
            f"field 'images[0]': no such image file: {tmp_path / 'missing.png'}",
            "missing_image",
        ),
        (  # a file the process cannot read (an I/O error here; EACCES for another user's): a traceback
            record(["/proc/self/mem"]),
            "field 'images[0]': cannot read image file /proc/self/mem (Input/output error)",
            "unreadable_image",
        ),
        (
            record(["truncated.png"]),
            f"field 'images[0]': not an image PIL can open ({len(good) // 2} bytes: image file is truncated)",
            "bad_image",
        ),
        (
            record(["text.png"]),
            "field 'images[0]': not an image PIL can open (12 bytes: no image format PIL knows)",
            "bad_image",
        ),
        (
            record([5]),
            "field 'images[0]': expected a path, bytes or a {'bytes', 'path'} struct, got 5",
            "bad_image",
        ),
        (
            record(["text.png"], completion=[{"type": "image"}, {"type": "text", "text": "red"}]),
            "field 'completion[0].content': an image part in a completion: KTO scores the completion's tokens "
            "and an image has none; put the images in the prompt",
            "image_in_completion",
        ),
        (
            record([], prompt_content=[{"type": "video"}]),
            "field 'prompt[0].content[0]': expected {'type': "
            "'image'} or {'type': 'text', 'text': str}, got {\"type\": \"video\"}",
            "bad_content_part",
        ),
        (
            record([], prompt_content=[{"type": "text", "text": "cut \ud83d"}]),
            "field 'prompt[0].content': not "
            "valid Unicode: a lone surrogate '\\ud83d' at character 4 (a string cut inside a UTF-16 pair)",
            "bad_text",
        ),
    ]


def test_bad_images_name_file_line_and_field(tmp_path: Path) -> None:
    cases = bad_cases(tmp_path)
    for row, expected, reason in cases:
        text_only = record([], prompt_content=[{"type": "text", "text": "Hi"}])  # parts, no image: fine
        path = write_jsonl([text_only, row], tmp_path / "train.jsonl")
        with pytest.raises(DataError) as info:
            load_records([str(path)], images=True)
        assert (str(info.value), info.value.reason) == (f"{path}:2: {expected}", reason)


def test_bad_images_are_skipped_and_counted(tmp_path: Path) -> None:
    cases = bad_cases(tmp_path)
    (tmp_path / "ok.png").write_bytes(png((0, 0, 255)))
    path = write_jsonl([record(["ok.png"])] + [row for row, _, _ in cases], tmp_path / "train.jsonl")
    result = load_records([str(path)], on_bad_record="skip", images=True)
    assert len(result.records) == 1
    reasons = [bad.reason for bad in result.skipped]
    assert {r: reasons.count(r) for r in reasons} == {
        "image_count": 2,
        "missing_image": 1,
        "unreadable_image": 1,
        "bad_image": 6,
        "image_in_completion": 1,
        "bad_content_part": 1,
        "bad_text": 1,
    }


def test_image_records_are_refused_by_default(tmp_path: Path) -> None:
    """load_records reads no images unless asked (a text-only model, inspect): an image record is one line."""
    (tmp_path / "a.png").write_bytes(png((255, 0, 0)))
    path = write_jsonl([record(["a.png"])], tmp_path / "train.jsonl")
    with pytest.raises(DataError) as info:
        load_records([str(path)])
    assert str(info.value) == (
        f"{path}:1: field 'images': images are read only for a vision-language model.path (Gemma 3, Gemma 4 or "
        "Qwen 3.5), and this one reads text alone; drop the field to train on the text"
    )
    path = write_jsonl([record([])], tmp_path / "train.jsonl")  # content parts without images
    with pytest.raises(DataError) as info:
        load_records([str(path)])
    assert str(info.value) == (
        f"{path}:1: field 'prompt[0].content': a list of content parts (image, text: TRL's vision-language "
        "format), read only for a vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5): give the content "
        "as one string"
    )


def test_a_hub_datasets_image_paths_are_refused_even_absolute(tmp_path: Path, monkeypatch) -> None:
    """From a security audit: a Hub dataset (no folder: ``base`` None) whose ``images`` named an absolute path or
    one from ``~`` read that file of this machine into the prepared data (and so into training, and a pushed
    model). Its images are read as bytes only; its bytes still load."""
    from coati_kto.data.formats import RecordError, show_value
    from coati_kto.data.image_refs import read_images

    secret = tmp_path / "home" / "secret.png"
    secret.parent.mkdir()
    secret.write_bytes(png((1, 2, 3)))
    monkeypatch.setenv("HOME", str(secret.parent))
    for ref in (str(secret), "~/secret.png", "secret.png", {"bytes": None, "path": str(secret)}):
        with pytest.raises(RecordError) as err:
            read_images([ref], "me/data:row 1", None, 1)
        shown = ref["path"] if isinstance(ref, dict) else ref
        assert str(err.value) == (
            f"me/data:row 1: field 'images[0]': an image path {show_value(shown)} in a Hub dataset: its images are "
            "read as bytes or from its own downloaded files only (any other path names a file on this machine)"
        )
        assert err.value.reason == "missing_image"
    assert read_images([{"bytes": png((1, 2, 3)), "path": "x.png"}], "me/data:row 1", None, 1) == [
        png((1, 2, 3))
    ]
    # An imagefolder repo's images, as datasets hands them: the downloaded copy's path, under the hub cache (the
    # review of this fix: every such dataset was refused).
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    blob = tmp_path / "hub" / "datasets--me--data" / "blobs" / "a.png"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(png((4, 5, 6)))
    assert read_images([{"bytes": None, "path": str(blob)}], "me/data:row 1", None, 1) == [png((4, 5, 6))]
