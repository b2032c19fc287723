"""Evaluation samples with their images (issue 49, coati_kto.trainer.sample_images): greedy generation takes the
prompts' pixels on the prefill forward and decodes what a full forward with the image decodes at every token;
the logged image is the record's, down-scaled to at most 256 px. The run's TensorBoard and W&B entries:
tests/distributed/test_image_train.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from coati_kto.models.generate import PromptImages, greedy_generate
from coati_kto.models.vision import vision_family
from coati_kto.testing.image_rows import stored
from coati_kto.testing.tiny_processors import write_vl
from coati_kto.trainer.sample_images import LOGGED_SIDE, SampleImages, logged_image

NEW_TOKENS = 5


def _png(size: tuple[int, int], colour: tuple[int, int, int], noise: int = 0) -> bytes:
    pixels = np.full((size[1], size[0], 3), colour, dtype=np.int16)
    if noise:
        pixels += np.random.default_rng(noise).integers(-40, 40, pixels.shape, dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def _greedy_without_cache(model, prompt: list[int], images: PromptImages, eos: list[int]) -> list[int]:
    """Greedy tokens from full forwards of the prompt and the tokens so far, with the image, at every step."""
    family = vision_family(model.config)
    extras = {k: images.extras[k] for k in family.tower_keys + family.text_keys}
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        tensor = torch.tensor([ids])
        types = {family.token_types: (tensor == images.image_token_id).long()}
        with torch.no_grad():
            logits = model(
                input_ids=tensor, pixel_values=images.pixel_values, use_cache=False, **types, **extras
            )
        ids.append(int(logits.logits[0, -1].argmax()))
        if ids[-1] in eos:
            break
    return ids[len(prompt) :]


@pytest.mark.parametrize("family", ["gemma3_vl", "gemma4_vl", "qwen3_5_vl"])
def test_generation_with_images_decodes_as_full_forwards_with_the_image_do(
    tmp_path: Path, family: str
) -> None:
    """Two left-padded prompts of different lengths, each with its own image: the cached decode (the pixels on
    the prefill only; Qwen 3.5's M-RoPE positions from its grid) gives the tokens of full forwards that see the
    image at every step. Without the images the Gemma decodes differ (the image matters to those models; the
    tiny Qwen 3.5's greedy tokens do not move with these images)."""
    from transformers import AutoModelForImageTextToText

    from coati_kto.data.processors import load_processor_for_images

    write_vl(tmp_path / "model", family)
    processor = load_processor_for_images(str(tmp_path / "model"))
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    tokenizer = processor.tokenizer
    rows = [
        {"images": [_png((32, 32), (230, 20, 20), noise=1)]},
        {"images": [_png((48, 32), (30, 40, 220), 2)]},
    ]
    refs, table = stored(rows)
    images = SampleImages(
        processor.image_processor, tokenizer.convert_tokens_to_ids(tokenizer.image_token), table
    )
    prompts = []
    for row, question in zip(
        rows, ["What colour?", "What colour is the shape in this picture?"], strict=True
    ):
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True,
        )
        image = Image.open(io.BytesIO(row["images"][0]))
        prompts.append(list(processor(text=[text], images=[[image]])["input_ids"][0]))
    assert len(prompts[0]) != len(prompts[1])
    eos = [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id
    got = greedy_generate(
        model, prompts, NEW_TOKENS, pad, eos, torch.device("cpu"), False, images.prompt_images(refs)
    )
    want = [
        _greedy_without_cache(model, p, images.prompt_images([r]), eos)
        for p, r in zip(prompts, refs, strict=True)
    ]
    assert got == want
    if family != "qwen3_5_vl":
        assert greedy_generate(model, prompts, NEW_TOKENS, pad, eos, torch.device("cpu"), False) != got


def test_generation_with_images_never_emits_the_image_token(tmp_path: Path) -> None:
    """A completion holding the image token has no image to fill it: scoring the sample (prompt and completion,
    with the prompt's images) raised "Image features and image tokens do not match" and ended the evaluation.
    Here the tiny Gemma 3 is pushed to prefer that token at every step."""
    from transformers import AutoModelForImageTextToText

    from coati_kto.data.processors import load_processor_for_images

    write_vl(tmp_path / "model", "gemma3_vl")
    processor = load_processor_for_images(str(tmp_path / "model"))
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    tokenizer = processor.tokenizer
    soft = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    row = {"images": [_png((32, 32), (230, 20, 20), noise=1)]}
    (ref,), table = stored([row])
    images = SampleImages(processor.image_processor, soft, table)
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
        add_generation_prompt=True,
    )
    prompt = list(processor(text=[text], images=[[Image.open(io.BytesIO(row["images"][0]))]])["input_ids"][0])

    def prefer_the_image_token(module: object, inputs: object, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., soft] += 1e4
        return logits

    model.get_output_embeddings().register_forward_hook(prefer_the_image_token)
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    got = greedy_generate(
        model, [prompt], NEW_TOKENS, pad, eos, torch.device("cpu"), False, images.prompt_images([ref])
    )
    assert len(got[0]) == NEW_TOKENS and soft not in got[0]


def test_the_logged_image_is_the_records_first_down_scaled_to_256_px() -> None:
    small = _png((40, 32), (10, 200, 30), noise=3)
    rows = [{"images": [small, _png((8, 8), (0, 0, 0))]}, {"images": []}, {"label": True}]
    (row, empty, text), table = stored(rows)
    images = SampleImages(None, 0, table)
    chw = images.logged(row)
    assert chw.dtype == np.uint8 and chw.shape == (3, 32, 40)
    assert np.array_equal(chw.transpose(1, 2, 0), np.asarray(Image.open(io.BytesIO(small)).convert("RGB")))
    big = logged_image(_png((1024, 512), (200, 100, 50)))
    assert big.shape == (3, LOGGED_SIDE // 2, LOGGED_SIDE)  # the aspect ratio kept
    assert (big == np.array([200, 100, 50], dtype=np.uint8)[:, None, None]).all()  # a flat colour stays exact
    assert images.logged(empty) is None and images.logged(text) is None
