"""Image records tokenized through a vision-language processor (issue 49 steps 0 and 3), on the tiny Gemma 3
processor (coati_kto.testing.tiny_processors): the stored ids are the processor's, the completion does not move,
the prompt hash tells images apart."""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers import AutoProcessor

from coati_kto.data.images import image_stats
from coati_kto.data.tokenize import Encoder, prompt_hash
from coati_kto.testing.tiny_processors import gemma3_processor

ASK = [{"type": "image"}, {"type": "text", "text": "What colour is it?"}]


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, "PNG")
    return buf.getvalue()


def pil(image: bytes) -> Image.Image:
    return Image.open(io.BytesIO(image))


@pytest.fixture(scope="module")
def processor():
    return gemma3_processor()


def rows(prompts: list[list], images: list[list[bytes]], completion: str = "red") -> dict[str, list]:
    n = len(prompts)
    return {
        "prompt": [json.dumps([{"role": "user", "content": p}]) for p in prompts],
        "completion": [json.dumps([{"role": "assistant", "content": completion}])] * n,
        "chat": [True] * n,
        "source": [f"train.jsonl:{i + 1}" for i in range(n)],
        "tools": [""] * n,
        "images": images,
    }


def test_the_tiny_gemma3_processor_round_trips(processor, tmp_path: Path) -> None:
    tok = processor.tokenizer
    # The model side sizes its vocabulary to len(tokenizer) and sets image_token_index to the soft token.
    assert (len(tok), tok.image_token_id, tok.boi_token_id, tok.eoi_token_id) == (474, 473, 471, 472)
    assert tok.convert_ids_to_tokens([471, 472, 473]) == [
        "<start_of_image>",
        "<end_of_image>",
        "<image_soft_token>",
    ]
    text = processor.apply_chat_template([{"role": "user", "content": ASK}], add_generation_prompt=True)
    assert (
        text
        == "<bos><start_of_turn>user\n<start_of_image>What colour is it?<end_of_turn>\n<start_of_turn>model\n"
    )
    image = pil(png((255, 0, 0)))
    first = processor(text=[text], images=[image])
    processor.save_pretrained(tmp_path)
    again = AutoProcessor.from_pretrained(tmp_path)
    second = again(text=[text], images=[image])
    assert type(again).__name__ == "Gemma3Processor"
    assert type(again.image_processor).__name__ == "Gemma3ImageProcessorPil"
    assert second["input_ids"] == first["input_ids"]
    assert first["input_ids"][0].count(473) == 4  # image_seq_length soft tokens
    assert np.asarray(first["pixel_values"]).shape == (1, 3, 28, 28)
    assert np.array_equal(np.asarray(second["pixel_values"]), np.asarray(first["pixel_values"]))


def test_stored_ids_are_the_processors(processor) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    two = [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    batch = rows([ASK, two], [[red], [red, blue]])
    out = Encoder(processor.tokenizer, processor=processor)(batch)
    assert out["error"] == ["", ""]
    for i, (prompt, images) in enumerate([(ASK, [red]), (two, [red, blue])]):
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": "red"}]
        whole = processor.apply_chat_template(messages)
        expected = processor(text=[whole], images=[pil(b) for b in images])["input_ids"][0]
        assert out["prompt_ids"][i] + out["completion_ids"][i] == expected
    assert [len(p) for p in out["prompt_ids"]] == [35, 38]
    assert out["images"] == [1, 2]
    assert out["image_tokens"] == [4, 8]
    assert out["completion_end"] == ["stop:<end_of_turn>", "stop:<end_of_turn>"]


def test_the_encoder_pickles_with_its_processor(processor) -> None:
    """prepare tokenizes in data.num_proc worker processes: the Encoder travels pickled."""
    encoder = Encoder(processor.tokenizer, processor=processor)
    batch = rows([ASK], [[png((0, 255, 0))]])
    assert pickle.loads(pickle.dumps(encoder))(batch) == encoder(batch)


def test_the_completion_is_unchanged_by_the_image(processor) -> None:
    """The same completion tokens with or without the image: only the prompt grows (by the image's run)."""
    encoder = Encoder(processor.tokenizer, processor=processor)
    with_image = encoder(rows([ASK], [[png((255, 0, 0))]]))
    text_only = encoder(rows([[{"type": "text", "text": "What colour is it?"}]], [[]]))
    assert with_image["completion_ids"] == text_only["completion_ids"]
    assert processor.tokenizer.decode(with_image["completion_ids"][0]) == "red<end_of_turn>\n"
    assert with_image["boundary_inside_token"] == text_only["boundary_inside_token"] == [False]
    # "\n\n<start_of_image>" + 4 soft tokens + "<end_of_image>\n\n": 10 more prompt tokens
    assert [len(with_image["prompt_ids"][0]), len(text_only["prompt_ids"][0])] == [35, 25]


def test_prompt_hash_holds_the_image_digests(processor) -> None:
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    out = Encoder(processor.tokenizer, processor=processor)(rows([ASK, ASK, ASK], [[red], [blue], [red]]))
    assert out["prompt_ids"][0] == out["prompt_ids"][1]  # Gemma 3: the same ids for another image
    h = out["prompt_hash"]
    assert h[0] != h[1] and h[0] == h[2]
    text = "x"
    plain = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    assert prompt_hash(text) == plain  # text-only prompts keep their hash (prepared stores stay valid)
    with_red = hashlib.blake2b(text.encode(), digest_size=8)
    with_red.update(hashlib.sha256(red).digest())
    assert prompt_hash(text, [red]) == int.from_bytes(with_red.digest(), "little") >> 1


def test_placeholders_must_match_the_images(processor) -> None:
    out = Encoder(processor.tokenizer, processor=processor)(
        rows([ASK], [[png((255, 0, 0)), png((0, 0, 255))]])
    )
    assert out["error_reason"] == ["image_placeholders"]
    assert out["error"] == [
        "train.jsonl:1: field 'images': 2 image(s), but the chat template rendered '<start_of_image>' "
        "placeholders: 1 in the prompt; use a template that renders each image part as '<start_of_image>'"
    ]
    in_completion = Encoder(processor.tokenizer, processor=processor)(
        rows([ASK], [[png((1, 2, 3))]], "<start_of_image>")
    )
    assert in_completion["error"] == [
        "train.jsonl:1: field 'images': 1 image(s), but the chat template rendered '<start_of_image>' "
        "placeholders: the completion holds one; use a template that renders each image part as '<start_of_image>'"
    ]


def test_the_soft_token_typed_in_a_record_is_refused(processor) -> None:
    """Gemma 3's soft token is not its placeholder: typed in a completion it passed prepare as an image token under
    the loss mask, and training then said the processor had changed ("prepare it again", which changed nothing)."""
    encoder = Encoder(processor.tokenizer, processor=processor)
    out = encoder(rows([ASK], [[png((1, 2, 3))]], "red <image_soft_token>"))
    assert out["error_reason"] == ["image_placeholders"]
    assert out["error"] == [
        "train.jsonl:1: field 'images': the completion holds the image token '<image_soft_token>' as text; only "
        "the processor places it (one run per image, from the '<start_of_image>' placeholder): remove it"
    ]


def test_image_stats() -> None:
    stats = image_stats(np.array([1, 0, 2, 1]), np.array([4, 0, 8, 4]), np.array([36, 20, 60, 44]))
    assert stats == {
        "images_per_record": {"0": 1, "1": 2, "2": 1},
        "image_tokens": 16,
        "image_token_share": 0.1,
    }
