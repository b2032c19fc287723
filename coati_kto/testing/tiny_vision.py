"""Tiny random vision-language models (``coati_kto.testing.tiny``'s ``gemma3_vl``, ``gemma4_vl``, ``qwen3_5_vl``)
whose image changes the completion's logits: each tower projects into the text model's width, and Gemma 3's
projector (zero in transformers) is drawn at random.

``build_vision_language(family, text, tokenizer, seed)`` wraps the family's tiny text config ``text``. Where
``tokenizer`` names the family's multimodal tokens (``extra_special_tokens``: ``tokenizer.image_token`` and the
like, what the family's processor reads), the model's config points at them; a text tokenizer leaves the config's
defaults (outside the vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

# Gemma 4's vision tower (the default config has none): one layer, 4-pixel patches pooled 2 x 2; its image
# processor then takes max_soft_tokens 70 with the same patch and pooling sizes (docs/image_feedback_plan.md §2).
GEMMA4_VISION: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "patch_size": 4,
    "pooling_kernel_size": 2,
    "position_embedding_size": 64,
}
# Gemma 3's SigLIP tower: one layer, 28-pixel images in 14-pixel patches (4 image tokens).
GEMMA3_VISION: dict[str, Any] = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 28,
    "patch_size": 14,
}
# family -> {tokenizer attribute: the config key of its id}.
MULTIMODAL_TOKENS: dict[str, dict[str, str]] = {
    "gemma3_vl": {
        "image_token": "image_token_index",
        "boi_token": "boi_token_index",
        "eoi_token": "eoi_token_index",
    },
    "gemma4_vl": {
        "image_token": "image_token_id",
        "boi_token": "boi_token_id",
        "eoi_token": "eoi_token_id",
        "video_token": "video_token_id",
        "audio_token": "audio_token_id",
        "boa_token": "boa_token_id",
        "eoa_token": "eoa_token_index",
    },
    "qwen3_5_vl": {
        "image_token": "image_token_id",
        "video_token": "video_token_id",
        "vision_start_token": "vision_start_token_id",
        "vision_end_token": "vision_end_token_id",
    },
}


def multimodal_token_ids(family: str, tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """``family``'s config keys for the multimodal tokens ``tokenizer`` names (MULTIMODAL_TOKENS); {} for a text
    tokenizer."""
    out = {}
    for attribute, key in MULTIMODAL_TOKENS[family].items():
        token = getattr(tokenizer, attribute, None)
        if isinstance(token, str):
            out[key] = tokenizer.convert_tokens_to_ids(token)
    return out


def build_vision_language(
    family: str, text: Any, tokenizer: PreTrainedTokenizerFast, seed: int = 0
) -> PreTrainedModel:
    """``family``'s ``...ForConditionalGeneration`` around the tiny text config ``text``, randomly initialised from
    ``seed``; its tower's output as wide as ``text.hidden_size``."""
    if family == "gemma3_vl":
        return _gemma3(text, tokenizer, seed)
    from transformers import Gemma4VisionConfig

    from coati_kto.families import auto_model_class
    from coati_kto.testing.tiny_types import tiny_config

    config = tiny_config(family[: -len("_vl")], tokenizer)  # the towers of transformers' defaults, shrunk
    config.text_config = text
    if family == "gemma4_vl":
        config.vision_config = Gemma4VisionConfig(
            **GEMMA4_VISION
        )  # embed_vision projects into the text width
    else:  # Qwen 3.5: one block (tiny_types.TYPE_KEYS), its merger projecting into the text width
        config.vision_config.out_hidden_size = text.hidden_size
    for key, token_id in multimodal_token_ids(family, tokenizer).items():
        setattr(config, key, token_id)
    torch.manual_seed(seed)
    return auto_model_class(config).from_config(config)


def _gemma3(text: Any, tokenizer: PreTrainedTokenizerFast, seed: int) -> PreTrainedModel:
    """Gemma3ForConditionalGeneration around ``text`` with GEMMA3_VISION's tower; without the tokenizer's image token
    its image token lies outside the text vocabulary (as Gemma 3's own does at 262144). The projector is drawn
    at random (std: the text's initializer_range): transformers starts it at zero (modeling_gemma3.py:427), so
    an image would change no logit."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    tokens = {"image_token_index": len(tokenizer), **multimodal_token_ids("gemma3_vl", tokenizer)}
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=SiglipVisionConfig(**GEMMA3_VISION).to_dict(),
        mm_tokens_per_image=4,
        **tokens,
    )
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config)
    projector = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():  # its own generator: every other weight stays what seed gave before
        projector.normal_(0.0, text.initializer_range, generator=torch.Generator().manual_seed(seed))
    return model
