"""Evaluation samples with their images (issue 49, coati_kto.trainer.sample_images): greedy generation takes the
prompts' pixels on the prefill forward and decodes what a full forward with the image decodes at every token;
the logged image is the record's, down-scaled to at most 256 px. The run's TensorBoard and W&B entries:
tests/distributed/test_image_train.py."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from coati_kto.models.generate import greedy_generate
from coati_kto.testing.tiny_processors import write_gemma3_vl
from coati_kto.trainer.sample_images import LOGGED_SIDE, SampleImages, logged_image

NEW_TOKENS = 5


def _png(size: tuple[int, int], colour: tuple[int, int, int], noise: int = 0) -> bytes:
    pixels = np.full((size[1], size[0], 3), colour, dtype=np.int16)
    if noise:
        pixels += np.random.default_rng(noise).integers(-40, 40, pixels.shape, dtype=np.int16)
    out = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def _greedy_without_cache(
    model, prompt: list[int], pixels: torch.Tensor, image_id: int, eos: list[int]
) -> list:
    """Greedy tokens from full forwards of the prompt and the tokens so far, with the image, at every step."""
    ids = list(prompt)
    for _ in range(NEW_TOKENS):
        tensor = torch.tensor([ids])
        with torch.no_grad():
            logits = model(
                input_ids=tensor,
                pixel_values=pixels,
                token_type_ids=(tensor == image_id).long(),
                use_cache=False,
            ).logits
        ids.append(int(logits[0, -1].argmax()))
        if ids[-1] in eos:
            break
    return ids[len(prompt) :]


def test_generation_with_images_decodes_as_full_forwards_with_the_image_do(tmp_path: Path) -> None:
    """Two left-padded prompts of different lengths, each with its own image: the cached decode (the pixels on
    the prefill only) gives the tokens of full forwards that see the image at every step; without the images the
    decode differs (the image matters to this model)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    write_gemma3_vl(tmp_path / "model")
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    images = SampleImages(
        processor.image_processor, processor.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    )
    rows = [
        {"images": [_png((32, 32), (230, 20, 20), noise=1)]},
        {"images": [_png((48, 32), (30, 40, 220), 2)]},
    ]
    prompts = []
    for k, question in enumerate(["What colour?", "What colour is the shape in this picture?"]):
        text = processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True,
        )
        prompts.append(
            processor(text=[text], images=[[Image.open(io.BytesIO(rows[k]["images"][0]))]])["input_ids"][0]
        )
    assert len(prompts[0]) != len(prompts[1])
    pixels = images.prompt_images(rows)
    eos = [processor.tokenizer.eos_token_id]
    pad = processor.tokenizer.pad_token_id
    got = greedy_generate(model, prompts, NEW_TOKENS, pad, eos, torch.device("cpu"), False, pixels)
    want = [
        _greedy_without_cache(model, p, pixels.pixel_values[k : k + 1], pixels.image_token_id, eos)
        for k, p in enumerate(prompts)
    ]
    assert got == want
    assert greedy_generate(model, prompts, NEW_TOKENS, pad, eos, torch.device("cpu"), False) != got


def test_the_logged_image_is_the_records_first_down_scaled_to_256_px() -> None:
    small = _png((40, 32), (10, 200, 30), noise=3)
    row = {"images": [small, _png((8, 8), (0, 0, 0))]}
    chw = logged_image(row)
    assert chw.dtype == np.uint8 and chw.shape == (3, 32, 40)
    assert np.array_equal(chw.transpose(1, 2, 0), np.asarray(Image.open(io.BytesIO(small)).convert("RGB")))
    big = logged_image({"images": [_png((1024, 512), (200, 100, 50))]})
    assert big.shape == (3, LOGGED_SIDE // 2, LOGGED_SIDE)  # the aspect ratio kept
    assert (big == np.array([200, 100, 50], dtype=np.uint8)[:, None, None]).all()  # a flat colour stays exact
    assert logged_image({"images": []}) is None and logged_image({"label": True}) is None
