"""Image records through prepare, the prepared store and the collator (issue 49 step 4, Gemma 3), on the tiny
Gemma 3 processor (coati_kto.testing.tiny_processors) saved beside a Gemma 3 config (no weights: prepare reads
none)."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from transformers import Gemma3Config

from coati_kto.config.schema import Config
from coati_kto.data import store
from coati_kto.data.collator import KTOCollator
from coati_kto.data.files import write_jsonl
from coati_kto.data.formats import RecordError
from coati_kto.data.image_refs import digest
from coati_kto.data.images import image_cut
from coati_kto.data.prepared import prepare
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.weights import WeightSettings
from coati_kto.errors import ConfigError
from coati_kto.testing.tiny_processors import gemma3_processor

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
SOFT = 473  # the tiny tokenizer's <image_soft_token> (test_image_tokenize pins it)


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


def vl_model_dir(root: Path, **processor_kwargs: int) -> Path:
    """A folder holding a Gemma 3 (vision-language) config and the tiny processor: what prepare reads."""
    out = root / "vl-model"
    processor = gemma3_processor(**processor_kwargs)
    processor.save_pretrained(out)
    text = {"vocab_size": len(processor.tokenizer), "hidden_size": 16, "num_hidden_layers": 1}
    vision = {"hidden_size": 16, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}
    config = Gemma3Config(
        text_config=text, vision_config=vision, image_token_index=SOFT, mm_tokens_per_image=4
    )
    config.save_pretrained(out)
    return out


def image_rows(root: Path, image_last: tuple[bool, ...] = (False,) * 8, words: int = 0) -> Path:
    """8 records, each one image file (a path relative to the data file) and a question (``words`` x "please
    answer " before it), labels alternating (True first); ``image_last[i]``: record i's image after its text."""
    rows = []
    for i, last in enumerate(image_last):
        name = list(COLOURS)[i % 4]
        (root / f"{name}.png").write_bytes(png(COLOURS[name]))
        text = {"type": "text", "text": "please answer " * words + f"What colour is it? ({i})"}
        ask = [text, {"type": "image"}] if last else [{"type": "image"}, text]
        rows.append(
            {
                "prompt": [{"role": "user", "content": ask}],
                "completion": [{"role": "assistant", "content": name if i % 2 == 0 else "purple"}],
                "label": i % 2 == 0,
                "images": [f"{name}.png"],
            }
        )
    return write_jsonl(rows, root / "train.jsonl")


def processor_ids(processor, root: Path, source: str) -> list[int]:
    """The ids ``processor`` gives record ``source`` (file:line) of ``root``/train.jsonl, prompt and completion."""
    line = int(source.rsplit(":", 1)[1])
    record = json.loads((root / "train.jsonl").read_text().splitlines()[line - 1])
    images = [Image.open(root / name) for name in record["images"]]
    whole = processor.apply_chat_template(record["prompt"] + record["completion"])
    return processor(text=[whole], images=images)["input_ids"][0]


def settings(root: Path, model: Path, data: Path, images: bool = True, **extra) -> tuple:
    config = Config.model_validate(
        {
            "model": {"path": str(model)},
            "data": {"train_files": [str(data)], "prepared_dir": str(root / "prepared"), **extra},
            "train": {"micro_batch_size": 4, "seed": 1},
            "output": {"dir": str(root / "out")},
        }
    )
    return (
        PrepareSettings(config.data, config.model, config.train.seed, images),
        WeightSettings(config.kto, config.train.micro_batch_size),
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("images")
    model = vl_model_dir(root)
    data = image_rows(root)
    return root, model, data, prepare(*settings(root, model, data))


def test_the_store_holds_the_bytes_and_the_processors_ids(built) -> None:
    root, _, _, out = built
    processor = gemma3_processor()
    train = out.train
    assert len(train) == 8 and {"images", "image_tokens"} <= set(train.column_names)
    for row in train:
        line = int(row["source"].rsplit(":", 1)[1])
        image = (root / f"{list(COLOURS)[(line - 1) % 4]}.png").read_bytes()
        assert row["images"] == [digest(image)] and out.images.row_images(row) == [image]
        assert row["input_ids"] == processor_ids(processor, root, row["source"])
        assert row["image_tokens"] == 4 and row["input_ids"].count(SOFT) == 4
        # The KL row is prompt i (its image tokens too) + another row's completion.
        assert (
            row["kl_input_ids"][: row["kl_completion_start"]] == row["input_ids"][: row["completion_start"]]
        )
        partner = train[row["kl_index"]]
        assert (
            row["kl_input_ids"][row["kl_completion_start"] :]
            == partner["input_ids"][partner["completion_start"] :]
        )
    stats = out.stats["train"]["images"]
    tokens = sum(len(r) for r in train["input_ids"])
    assert stats == {"images_per_record": {"1": 8}, "image_tokens": 32, "image_token_share": 32 / tokens}
    assert set(json.loads((root / "prepared" / "fingerprint.json").read_text())["images"]) == {
        "processor",
        "images",
    }


def test_prepare_prints_the_images(built, capsys: pytest.CaptureFixture) -> None:
    root, model, data, out = built
    prepare(*settings(root, model, data))  # reused: the same fingerprint
    printed = capsys.readouterr().out
    assert printed.startswith(f"reusing {root / 'prepared'} (inputs, tokenizer and settings unchanged")
    share = 100 * out.stats["train"]["images"]["image_token_share"]
    assert f"    images per record: 8 with 1; image tokens 32 ({share:.1f}% of the tokens)" in printed


def gemma3_collator(out) -> tuple:
    """The tiny Gemma 3 processor and a collator over ``out`` (a read prepared build)'s image table."""
    processor = gemma3_processor()
    collate = KTOCollator(
        0,
        image_processor=processor.image_processor,
        image_token_id=SOFT,
        image_seq_length=4,
        image_table=out.images,
    )
    return processor, collate


def test_the_collated_pixels_are_the_processors(built) -> None:
    _, _, _, out = built
    processor, collate = gemma3_collator(out)
    rows = [out.train[i] for i in range(4)]
    batch = collate(rows)
    own = processor.image_processor(
        images=[Image.open(io.BytesIO(out.images.row_images(r)[0])) for r in rows], return_tensors="pt"
    )
    assert batch.images.pixel_values.shape == (4, 3, 28, 28)
    assert torch.equal(batch.images.pixel_values, own["pixel_values"])
    assert batch.images.image_rows.tolist() == [0, 1, 2, 3]
    ex, kl = batch.images.example_token_types, batch.images.kl_token_types
    assert ex.sum(1).tolist() == kl.sum(1).tolist() == [4, 4, 4, 4]
    for b, r in enumerate(rows):
        start = r["completion_start"]
        assert torch.equal(ex[b, :start], kl[b, :start])  # both views hold prompt b
        assert torch.equal(
            ex[b], (batch.example.input_ids[b] == SOFT).long() * batch.example.attention_mask[b]
        )
    moved = batch.to("cpu")
    assert moved.images is not batch.images and torch.equal(moved.images.pixel_values, own["pixel_values"])


def test_a_changed_processor_is_one_error_naming_the_row(built) -> None:
    _, _, _, out = built
    processor = gemma3_processor()
    collate = KTOCollator(
        0,
        image_processor=processor.image_processor,
        image_token_id=SOFT,
        image_seq_length=8,
        image_table=out.images,
    )
    with pytest.raises(ValueError) as err:
        collate([out.train[i] for i in range(2)])
    assert str(err.value) == (
        "row 0 (example view): 4 image tokens in its ids, but its 1 image(s) give 8 (8): the processor "
        "changed since the data was prepared; prepare it again"
    )


def test_the_collator_refuses_packed_layouts_with_images() -> None:
    processor = gemma3_processor()
    for kwargs in ({"padding_free": "one"}, {"padding_free": "bins", "sequence": (2, 0)}):
        with pytest.raises(ValueError) as err:
            KTOCollator(
                0,
                image_processor=processor.image_processor,
                image_token_id=SOFT,
                image_seq_length=4,
                **kwargs,
            )
        assert (
            str(err.value)
            == "images need padded rows: padding_free and sequence parallelism do not take them"
        )
    with pytest.raises(ValueError) as err:
        KTOCollator(0)(
            [
                {
                    "input_ids": [1, 2],
                    "completion_start": 1,
                    "label": True,
                    "kl_input_ids": [1, 2],
                    "kl_completion_start": 1,
                    "images": [png((0, 0, 0))],
                }
            ]
        )
    assert str(err.value) == "the rows hold images but the collator has no image_processor or image_table"


def test_changed_images_or_processor_change_the_fingerprint(tmp_path: Path) -> None:
    model = vl_model_dir(tmp_path)
    data = image_rows(tmp_path)
    prep, _ = settings(tmp_path, model, data)
    tokenizer = gemma3_processor().tokenizer
    first = store.fingerprint(prep, tokenizer, store.load_processor(prep))
    assert store.fingerprint(prep, tokenizer, store.load_processor(prep))["digest"] == first["digest"]
    (tmp_path / "red.png").write_bytes(png((250, 0, 0)))  # the data file is unchanged
    second = store.fingerprint(prep, tokenizer, store.load_processor(prep))
    assert second["train_files"] == first["train_files"]
    assert second["images"]["processor"] == first["images"]["processor"]
    assert second["images"]["images"] != first["images"]["images"] and second["digest"] != first["digest"]
    assert store._changed(first, second) == "images"
    vl_model_dir(tmp_path, image_seq_length=9)  # another processor config, same folder
    third = store.fingerprint(prep, tokenizer, store.load_processor(prep))
    assert third["images"]["processor"] != second["images"]["processor"]
    # Without the images flag (train, inspect) no processor is loaded and no image is read.
    assert store.load_processor(replace(prep, images=False)) is None


def test_the_fingerprint_reads_the_images_bytes_without_decoding_them(tmp_path: Path, monkeypatch) -> None:
    """Every launch computes the fingerprint, to reuse the prepared data: it decoded every image with PIL,
    5.9 s per 1000 images of 512 x 512 (JPEG) on each launch. The bytes are all the digest needs: an image
    that does not decode still changes it when fixed, and prepare itself still decodes each image."""
    from coati_kto.data import image_refs

    model = vl_model_dir(tmp_path)
    data = image_rows(tmp_path)
    (tmp_path / "blue.png").write_bytes(png(COLOURS["blue"])[:40])  # truncated: does not decode
    prep, _ = settings(tmp_path, model, data, on_bad_record="skip")
    tokenizer, decoded = gemma3_processor().tokenizer, []
    real = image_refs.check_decodes
    monkeypatch.setattr(
        image_refs, "check_decodes", lambda image, *a: decoded.append(image) or real(image, *a)
    )
    first = store.fingerprint(prep, tokenizer, store.load_processor(prep))
    assert decoded == []
    (tmp_path / "blue.png").write_bytes(png(COLOURS["blue"]))  # fixed
    assert store.fingerprint(prep, tokenizer, store.load_processor(prep))["digest"] != first["digest"]
    assert decoded == []
    prepare(prep, _)  # prepare decodes each of the 8 records' images
    assert len(decoded) == 8


def test_the_image_cut_boundary() -> None:
    """p_len 58, max_prompt_length 40: with its BOS kept a cut removes tokens [1, 19), without one [0, 18); an
    image run from there survives (58: no image). A prompt of 40 is never cut."""
    p_len, start = np.array([58, 58, 58, 58, 40]), np.array([19, 18, 17, 58, 3])
    cut = [False, True, True, False, False]
    assert image_cut(p_len, start, np.ones(5, np.int64), 40, 44, 4).tolist() == cut
    assert image_cut(p_len, start, np.zeros(5, np.int64), 40, 44, 4).tolist() == [
        False,
        False,
        True,
        False,
        False,
    ]
    # No pass cuts a prompt that fits with the split's longest completion (58 + 4 <= 62): all were dropped.
    assert not image_cut(p_len, start, np.ones(5, np.int64), 40, 62, 4).any()
    assert image_cut(p_len, start, np.ones(5, np.int64), 40, 62, 5).tolist() == cut  # one KL row is cut


def test_a_prompt_cut_into_an_image_is_dropped_and_counted(tmp_path: Path, capsys) -> None:
    """Prompts of 68 tokens cut to 40 (max_length 44): keeping the prompt's end cuts into an image placed first
    (dropped, counted) but not into one placed last (kept whole)."""
    model = vl_model_dir(tmp_path)
    data = image_rows(tmp_path, image_last=(False,) * 4 + (True,) * 4, words=6)
    out = prepare(*settings(tmp_path, model, data, max_length=44, max_prompt_length=40))
    split = out.stats["train"]
    assert split["lengths"]["prompt"]["max"] == 68 and split["dropped"] == {"image_cut": 4}
    assert split["truncated"]["prompt"] == split["truncated"]["kl_prompt"] == 4
    assert "dropped: image_cut 4 (each named in skipped.txt);" in capsys.readouterr().out
    lines = (tmp_path / "prepared" / "skipped.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["image_cut"] * 4
    assert lines[0] == (
        f"image_cut\t{data}:1: a prompt of 68 tokens, cut to data.max_prompt_length 40 where a pass is longer "
        "than data.max_length 44, would cut an image"
    )
    # max_length 80 holds every example and KL row whole: nothing is cut, so nothing is dropped, even with
    # data.on_too_long: error (every image row whose prompt passed max_prompt_length was dropped).
    whole = prepare(
        *settings(tmp_path, model, data, max_length=80, max_prompt_length=40, on_too_long="error")
    )
    assert len(whole.train) == 8 and not whole.stats["train"].get("dropped")
    processor = gemma3_processor()
    assert [r.rsplit(":", 1)[1] for r in out.train["source"]] == ["5", "6", "7", "8"]
    for row in out.train:
        whole = processor_ids(processor, tmp_path, row["source"])
        start = row["completion_start"]
        assert start == 40 and row["input_ids"][:start] == whole[:1] + whole[68 - 39 : 68]
        assert row["input_ids"].count(SOFT) == row["kl_input_ids"].count(SOFT) == 4


def test_a_text_only_model_keeps_the_refusal(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = image_rows(tmp_path)
    with pytest.raises(RecordError) as err:
        prepare(*settings(tmp_path, tiny_model_dir, data))
    assert str(err.value) == f"{data}:1: field 'images': {TEXT_ONLY}"


TEXT_ONLY = (
    "images are read only for a vision-language model.path (Gemma 3, Gemma 4 or Qwen 3.5), and this one reads "
    "text alone; drop the field to train on the text"
)


def test_a_text_only_model_refuses_images_beside_string_contents(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """String contents with an ``images`` field trained a text-only model on the text alone, said only as an
    unread field."""
    rows = [json.loads(line) for line in image_rows(tmp_path).read_text().splitlines()]
    for row in rows:
        row["prompt"] = [{"role": "user", "content": "What colour is it?"}]
    data = write_jsonl(rows, tmp_path / "strings.jsonl")
    with pytest.raises(RecordError) as err:
        prepare(*settings(tmp_path, tiny_model_dir, data))
    assert (str(err.value), err.value.reason) == (f"{data}:1: field 'images': {TEXT_ONLY}", "images_unread")
    for row in rows:
        row["images"] = []  # no image named: the text is the record
    prepare(*settings(tmp_path, tiny_model_dir, write_jsonl(rows, tmp_path / "strings.jsonl")))


def test_a_processor_of_another_checkpoint_is_refused_before_training(tmp_path: Path) -> None:
    """image_seq_length 9 against the model's mm_tokens_per_image 4: prepare passed and step 1 raised "Image
    features and image tokens do not match" in the forward, a traceback on every rank."""
    from coati_kto.config.schema import ModelSection
    from coati_kto.data.image_store import collator_images

    assert collator_images(ModelSection(path=str(vl_model_dir(tmp_path))))["image_seq_length"] == 4
    other = vl_model_dir(tmp_path / "other", image_seq_length=9)
    with pytest.raises(ConfigError) as err:
        collator_images(ModelSection(path=str(other)))
    assert str(err.value) == (
        f"model.path {other}: its processor gives 9 image tokens per image (image_seq_length) and its model takes "
        "4 (mm_tokens_per_image): the processor files are another checkpoint's; use the model's own"
    )


def test_inspect_reads_image_records(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``coati-kto inspect`` of a vision-language model's image records refused them, saying that only prepare
    and train read them."""
    from coati_kto.cli import main

    cfg = {
        "model": {"path": str(vl_model_dir(tmp_path))},
        "data": {"train_files": [str(image_rows(tmp_path))], "prepared_dir": str(tmp_path / "prepared")},
        "train": {"micro_batch_size": 2},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["inspect", str(tmp_path / "cfg.yaml"), "--examples", "1"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 batch 0: [" in out and out.count("  KL completion | ") == 1


def test_the_prepare_command_reads_images(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``coati-kto prepare`` sets PrepareSettings.images (train and inspect do too)."""
    from coati_kto.cli import main

    cfg = {
        "model": {"path": str(vl_model_dir(tmp_path))},
        "data": {"train_files": [str(image_rows(tmp_path))], "prepared_dir": str(tmp_path / "prepared")},
        "output": {"dir": str(tmp_path / "out")},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["prepare", str(tmp_path / "cfg.yaml")]) == 0
    assert "    images per record: 8 with 1; image tokens 32 (" in capsys.readouterr().out


def test_a_model_folder_without_a_config_reads_no_images(tmp_path: Path) -> None:
    """prepare needs only a tokenizer: a folder holding no config.json is no vision-language model, no error."""
    folder = tmp_path / "tokenizer-only"
    gemma3_processor().tokenizer.save_pretrained(folder)
    prep, _ = settings(tmp_path, folder, image_rows(tmp_path))
    assert store.load_processor(prep) is None


def test_a_vision_language_folder_without_its_processor_prepares_text_records(tmp_path: Path) -> None:
    """A VL checkpoint saved without its processor files (the tiny families' folders, many fine-tunes) keeps
    preparing text records as before train read images; image records get the load's one line."""
    folder = vl_model_dir(tmp_path)
    (folder / "processor_config.json").unlink()
    text = write_jsonl(
        [{"prompt": f"Question {i}?", "completion": "An answer.", "label": i % 2 == 0} for i in range(8)],
        tmp_path / "text.jsonl",
    )
    data = prepare(*settings(tmp_path, folder, text))
    assert "images" not in store.read_fingerprint(tmp_path / "prepared")
    assert len(data.train) == 8 and "images" not in data.train.column_names
    with pytest.raises(ConfigError) as err:
        prepare(*settings(tmp_path / "img", folder, image_rows(tmp_path)))
    assert str(err.value).startswith(f"model.path {folder}: ")


def test_the_same_words_about_other_images_are_other_prompts() -> None:
    """prepare's prompt identity (duplicates, the eval split's groups) holds the images' digests: the demo's 640
    records about 640 images were "632 repeats" and one prompt group before."""
    from coati_kto.data.formats import Record
    from coati_kto.data.splits import duplicates, prompt_key

    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    reply = [{"role": "assistant", "content": "red"}]

    def record(image: bytes, source: str) -> Record:
        return Record(prompt, reply, True, source, True, images=[image])

    red, blue = record(b"red pixels", "a:1"), record(b"blue pixels", "a:2")
    again = record(b"red pixels", "a:3")
    assert prompt_key(red) != prompt_key(blue)
    assert prompt_key(red) == prompt_key(again)
    assert duplicates([red, blue, again]) == (1, ["a:3 = a:1"])
    text = Record(prompt, reply, True, "a:4", True)  # no images: the key of text records is unchanged
    assert prompt_key(text) == json.dumps(prompt, sort_keys=True, ensure_ascii=False)
