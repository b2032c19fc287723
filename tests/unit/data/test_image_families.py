"""Gemma 4 and Qwen 3.5 image records (issue 49): their processors without a video processor (no torchvision,
coati_kto.data.processors), the stored ids (variable image token counts), and the collated tower inputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from coati_kto.data.collator import KTOCollator
from coati_kto.data.image_refs import digest
from coati_kto.data.processors import load_processor_for_images
from coati_kto.data.tokenize import Encoder
from coati_kto.testing.image_rows import stored
from coati_kto.testing.tiny_processors import write_vl

FAMILIES = ["gemma4_vl", "qwen3_5_vl"]
ONE = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]
TWO = [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "?"}]
# family -> (processor class, image tokens of a 32 x 32 image, of a 48 x 32 one, the tower's extra key).
EXPECTED = {
    "gemma4_vl": ("Gemma4ImageProcessing", 64, 60, "image_position_ids"),
    "qwen3_5_vl": ("Qwen3VLImageProcessing", 4, 2, "image_grid_thw"),
}


def png(colour: tuple[int, int, int], width: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, 32), colour).save(buf, "PNG")
    return buf.getvalue()


def pil(image: bytes) -> Image.Image:
    return Image.open(io.BytesIO(image))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, write_vl(tmp_path_factory.mktemp(request.param), request.param)


def rows(prompts: list[list], images: list[list[bytes]]) -> dict[str, list]:
    n = len(prompts)
    return {
        "prompt": [json.dumps([{"role": "user", "content": p}]) for p in prompts],
        "completion": [json.dumps([{"role": "assistant", "content": "red"}])] * n,
        "chat": [True] * n,
        "source": [f"train.jsonl:{i + 1}" for i in range(n)],
        "tools": [""] * n,
        "images": images,
    }


def test_the_folder_loads_without_a_video_processor_and_names_the_hub_class(family) -> None:
    from transformers import AutoProcessor

    name, path = family
    processor = load_processor_for_images(str(path))
    assert type(processor).__name__ == EXPECTED[name][0]
    assert not hasattr(processor, "video_processor")
    assert type(processor.image_processor).__name__.endswith("ImageProcessorPil")
    hub = {"gemma4_vl": "Gemma4Processor", "qwen3_5_vl": "Qwen3VLProcessor"}[name]
    assert json.loads((path / "processor_config.json").read_text())["processor_class"] == hub
    assert "processor_class" in json.loads((path / "preprocessor_config.json").read_text())
    with pytest.raises((OSError, ImportError)):  # what the project-side class stands in for
        AutoProcessor.from_pretrained(path)


def test_stored_ids_are_the_processors_with_variable_image_counts(family) -> None:
    name, path = family
    processor = load_processor_for_images(str(path))
    small, wide = png((255, 0, 0)), png((0, 0, 255), width=48)
    batch = rows([ONE, TWO], [[small], [small, wide]])
    out = Encoder(processor.tokenizer, processor=processor)(batch)
    assert out["error"] == ["", ""]
    for i, (prompt, images) in enumerate([(ONE, [small]), (TWO, [small, wide])]):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "red"}]
        whole = processor.apply_chat_template(messages)
        expected = processor(text=[whole], images=[[pil(b) for b in images]])["input_ids"][0]
        assert out["prompt_ids"][i] + out["completion_ids"][i] == list(expected)
    _, one, other, _ = EXPECTED[name]
    assert out["image_tokens"] == [one, one + other]  # the wide image gives another count


def _features(processor, images: list[list[bytes]]) -> list[dict]:
    """Rows as prepare stores them (ids through the processor, the image bytes), examples and KL pairs sharing
    their prompts."""
    tokenizer = processor.tokenizer
    out = []
    for i, found in enumerate(images):
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": ONE if len(found) == 1 else TWO}], add_generation_prompt=True
        )
        ids = list(processor(text=[prompt], images=[[pil(b) for b in found]])["input_ids"][0])
        answers = [tokenizer.encode(a, add_special_tokens=False) for a in (" red", " a blue one")]
        out.append(
            dict(
                input_ids=ids + answers[i % 2],
                completion_start=len(ids),
                label=i == 0,
                kl_input_ids=ids + answers[1 - i % 2],
                kl_completion_start=len(ids),
                images=found,
            )
        )
    return out


def test_the_collated_tower_inputs_are_the_processors(family) -> None:
    name, path = family
    processor = load_processor_for_images(str(path))
    small, wide = png((255, 0, 0)), png((0, 0, 255), width=48)
    images = [[small], [small, wide]]
    features, table = stored(_features(processor, images))
    collate = KTOCollator(
        processor.tokenizer.pad_token_id,
        image_processor=processor.image_processor,
        image_token_id=processor.tokenizer.image_token_id,
        image_table=table,
    )
    batch = collate(features)
    flat = [pil(b) for row in images for b in row]
    want = processor(text=[" ".join([processor.image_token] * 3)], images=[flat], return_tensors="pt")
    extra = EXPECTED[name][3]
    got = batch.images
    assert torch.equal(got.pixel_values, want["pixel_values"])
    assert torch.equal(getattr(got, extra), want[extra])
    other = {"image_position_ids", "image_grid_thw"} - {extra}
    assert getattr(got, other.pop()) is None
    assert got.image_rows.tolist() == [0, 1, 1]
    _, one, second, _ = EXPECTED[name]
    assert got.example_token_types.sum(1).tolist() == [one, one + second]
    assert got.kl_token_types.sum(1).tolist() == [one, one + second]
    prompt = features[1]["completion_start"]
    assert torch.equal(got.example_token_types[1, :prompt], got.kl_token_types[1, :prompt])
    for b, row in enumerate(
        images
    ):  # the token types: the processor's mm_token_type_ids on the prompt, then 0
        content = ONE if len(row) == 1 else TWO
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        own = processor(text=[text], images=[[pil(x) for x in row]], return_tensors="pt")[
            "mm_token_type_ids"
        ][0]
        start = features[b]["completion_start"]
        assert len(own) == start and torch.equal(got.example_token_types[b, :start], own)
        assert not got.example_token_types[b, start:].any()
    # Rows whose image is another size than prepare saw: another count, one error naming the row.
    swapped = [dict(features[0], images=[digest(wide)]), features[1]]
    with pytest.raises(ValueError) as err:
        collate(swapped)
    assert str(err.value) == (
        f"row 0 (example view): {one} image tokens in its ids, but its 1 image(s) give {second} ({second}): the "
        "processor changed since the data was prepared; prepare it again"
    )
