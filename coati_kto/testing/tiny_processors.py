"""Tiny vision-language processors built offline (no hub, no torchvision), for image-feedback tests.

``gemma3_processor``: Gemma 3's processor from its PIL image processor (28x28 pixels, 4 image tokens per image)
and the project's tiny byte-level BPE tokenizer (:func:`coati_kto.testing.tiny.build_tokenizer`, Gemma style)
with Gemma 3's three image tokens added.

``gemma4_processor`` and ``qwen3_5_processor``: the project-side processors of Gemma 4 and Qwen 3.5
(:mod:`coati_kto.data.processors`: the family's processor without a video processor, which would need
torchvision), from their PIL image processors (plan §2) and the same tokenizer with the family's multimodal tokens
named. Their image token counts depend on the pixels. ``write_vl`` saves a family's tiny model with its processor
as a hub-shaped folder (preprocessor, processor and tokenizer configs, the chat template), the processor config
naming the hub's class (``Gemma4Processor``, ``Qwen3VLProcessor``) as a checkpoint's does.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from coati_kto.data.processor_classes import Gemma4ImageProcessing, Qwen3VLImageProcessing
from coati_kto.data.processors import HUB_CLASS
from coati_kto.models.tiny import CHATML_TEMPLATE, TINY_CORPUS
from coati_kto.testing.tiny import build_tokenizer

# Gemma 3's names: <start_of_image> is the placeholder a template renders (the processor's ``image_token``),
# expanded to "\n\n<start_of_image>" + <image_soft_token> x image_seq_length + "<end_of_image>\n\n".
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}
# The tiny Gemma template (coati_kto.testing.tiny.GEMMA_TEMPLATE) with content parts: an image part renders as
# the placeholder, a text part as its text; a string content as itself.
GEMMA3_VL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


# Gemma 4's names (its hub tokenizer's): <|image|> is both the placeholder a template renders and the soft token,
# expanded to <|image> + <|image|> x (soft tokens of that image) + <image|>; the audio ones must be named too
# (Gemma4Processor.validate_inputs reads them).
GEMMA4_IMAGE_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}
GEMMA4_VL_TEMPLATE = GEMMA3_VL_TEMPLATE.replace("<start_of_image>", "<|image|>")
# Qwen 3.5's names: the template renders <|vision_start|><|image_pad|><|vision_end|>, and the processor expands
# <|image_pad|> to one per merged patch of that image (grid t*h*w / merge_size^2).
QWEN3_5_IMAGE_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
QWEN3_5_VL_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ message['content'] }}",
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}",
)


def _tokenizer(style: str, tokens: dict[str, str], template: str, vocab_size: int) -> Any:
    """The tiny BPE of ``style`` with ``tokens`` added as special tokens and named (``tokenizer.image_token``...:
    set only when loading, so saved and loaded with them), its chat template ``template``."""
    base = build_tokenizer(TINY_CORPUS, vocab_size=vocab_size, style=style)
    base.add_tokens(list(tokens.values()), special_tokens=True)
    base.chat_template = template
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp, extra_special_tokens=tokens)


def gemma3_processor(size: int = 28, image_seq_length: int = 4, vocab_size: int = 512) -> Gemma3Processor:
    """A tiny ``Gemma3Processor``: ``size`` x ``size`` pixels, ``image_seq_length`` soft tokens per image.

    The model it feeds must have a text vocabulary of ``len(processor.tokenizer)`` (the image tokens are the
    last three ids) and ``image_token_index = processor.tokenizer.image_token_id`` (the soft token, not the
    placeholder): the model side builds that. ``save_pretrained`` writes it and ``AutoProcessor.from_pretrained``
    reloads it with equal ids (the tokenizer config keeps the three tokens by name).
    """
    base = build_tokenizer(TINY_CORPUS, vocab_size=vocab_size, style="gemma")
    base.add_tokens(list(GEMMA3_IMAGE_TOKENS.values()), special_tokens=True)
    base.chat_template = GEMMA3_VL_TEMPLATE
    # The named image tokens (tokenizer.boi_token, ...) are set only when loading: save, then load with them.
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp, extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    image_processor = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_VL_TEMPLATE,
        image_seq_length=image_seq_length,
    )


def gemma4_processor(max_soft_tokens: int = 70, vocab_size: int = 512) -> Gemma4ImageProcessing:
    """A tiny Gemma 4 processor (no video processor): 4-pixel patches pooled 2 x 2 (the tiny Gemma 4 VL's tower,
    ``coati_kto.testing.tiny_vision.GEMMA4_VISION``), at most ``max_soft_tokens`` soft tokens per image (70, the
    least Gemma 4 allows: a 32 x 32 image gives 64, a 48 x 32 one 54)."""
    from transformers import Gemma4ImageProcessorPil
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    tokenizer = _tokenizer("gemma", GEMMA4_IMAGE_TOKENS, GEMMA4_VL_TEMPLATE, vocab_size)
    image_processor = Gemma4ImageProcessorPil(
        max_soft_tokens=max_soft_tokens, patch_size=4, pooling_kernel_size=2
    )
    return Gemma4ImageProcessing(
        Gemma4AudioFeatureExtractor(),
        image_processor,
        tokenizer,
        chat_template=GEMMA4_VL_TEMPLATE,
        image_seq_length=max_soft_tokens,
    )


def qwen3_5_processor(vocab_size: int = 512) -> Qwen3VLImageProcessing:
    """A tiny Qwen 3.5 processor (no video processor): 14-pixel patches merged 2 x 2, two frames per temporal
    patch, images resized to between 32^2 and 64^2 pixels (a 32 x 32 image gives 4 image tokens)."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer("chatml", QWEN3_5_IMAGE_TOKENS, QWEN3_5_VL_TEMPLATE, vocab_size)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=32**2, max_pixels=64**2
    )
    return Qwen3VLImageProcessing(image_processor, tokenizer, chat_template=QWEN3_5_VL_TEMPLATE)


def save_gemma3_processor(out_dir: str | Path, **kwargs: int) -> Path:
    """:func:`gemma3_processor` saved to ``out_dir`` (with a model's files, or alone); returns ``out_dir``."""
    out = Path(out_dir)
    gemma3_processor(**kwargs).save_pretrained(out)
    return out


PROCESSORS = {"gemma3_vl": gemma3_processor, "gemma4_vl": gemma4_processor, "qwen3_5_vl": qwen3_5_processor}


def write_vl(out_dir: str | Path, family: str = "gemma3_vl", seed: int = 0) -> Path:
    """A tiny vision-language checkpoint of ``family`` (PROCESSORS) in ``out_dir``: the model
    (``coati_kto.testing.tiny``'s, its image tokens the processor's) and its processor, what ``model.path`` of an
    image run names. Gemma 4's and Qwen 3.5's processor config names the hub's class, as a checkpoint's does."""
    from coati_kto.testing.tiny import build_family_model

    out = Path(out_dir)
    processor = PROCESSORS[family]()
    build_family_model(family, processor.tokenizer, seed).save_pretrained(out)
    processor.save_pretrained(out)
    model_type = family[: -len("_vl")]
    if model_type in HUB_CLASS:  # the hub's layout: the image processor's config in its own file
        config = json.loads((out / "processor_config.json").read_text())
        config["processor_class"] = HUB_CLASS[model_type]
        image = {**config.pop("image_processor"), "processor_class": HUB_CLASS[model_type]}
        for name, value in (("processor_config.json", config), ("preprocessor_config.json", image)):
            (out / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    return out


def write_gemma3_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """:func:`write_vl` of the tiny Gemma 3 VL (its projector random)."""
    return write_vl(out_dir, "gemma3_vl", seed)


def crossed_rows(
    prompts: list[list[int]], answers: list[list[int]], images: list[bytes] | None = None
) -> list[dict[str, Any]]:
    """Two prepared rows (the collator's features) from two prompts and two answers: row i is prompt i with answer
    i, labelled desirable for row 0, its KL pair prompt i with the other row's answer; ``images``: row i's image."""
    rows = []
    for i in range(2):
        row = dict(
            input_ids=list(prompts[i]) + answers[i],
            completion_start=len(prompts[i]),
            label=i == 0,
            kl_input_ids=list(prompts[i]) + answers[1 - i],
            kl_completion_start=len(prompts[i]),
        )
        rows.append(row if images is None else {**row, "images": [images[i]]})
    return rows
