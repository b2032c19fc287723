"""Tiny vision-language processors built offline (no hub, no torchvision), for image-feedback tests.

``gemma3_processor``: Gemma 3's processor from its PIL image processor (28x28 pixels, 4 image tokens per image)
and the project's tiny byte-level BPE tokenizer (:func:`coati_kto.testing.tiny.build_tokenizer`, Gemma style)
with Gemma 3's three image tokens added. Gemma 4 and Qwen 3.5 come later: their processors need a video
processor, and transformers' video processors need torchvision (docs/image_feedback_plan.md, §9 step 0).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from transformers import AutoTokenizer, Gemma3Processor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from coati_kto.models.tiny import TINY_CORPUS
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


def save_gemma3_processor(out_dir: str | Path, **kwargs: int) -> Path:
    """:func:`gemma3_processor` saved to ``out_dir`` (with a model's files, or alone); returns ``out_dir``."""
    out = Path(out_dir)
    gemma3_processor(**kwargs).save_pretrained(out)
    return out


def write_gemma3_vl(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 vision-language checkpoint in ``out_dir``: the model (``coati_kto.testing.tiny``'s
    ``gemma3_vl``, its projector random) and :func:`gemma3_processor`, what ``model.path`` of an image run names."""
    from coati_kto.testing.tiny import build_family_model

    out = Path(out_dir)
    processor = gemma3_processor()
    build_family_model("gemma3_vl", processor.tokenizer, seed).save_pretrained(out)
    processor.save_pretrained(out)
    return out
