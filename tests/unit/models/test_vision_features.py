"""What the image-feedback plan (docs/image_feedback_plan.md) rests on in transformers 5.24, pinned on tiny random
vision-language models (one image, two right-padded rows as an example and its KL pair):

- the tower's features, computed once for one image and handed to the forward as ``mm_encoder_outputs``, give
  exactly the logits of the ``pixel_values`` forward (so one computation can serve the example, its KL pair, the
  policy and the reference);
- Gemma 4's direct read of the embedding's pad row (modeling_gemma4.py:2385: the wrong row of a vocabulary-split
  embedding under tensor parallelism) feeds nothing when ``input_ids`` is given.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from coati_kto.testing.tiny_types import late_2026_shapes

VOCAB, IMAGE = 64, 60  # the image (soft) token lies inside the text vocabulary, as on the hub checkpoints
TOWER = dict(hidden_size=16, intermediate_size=32, num_attention_heads=2)


def _text(family: str) -> dict[str, Any]:
    """The family's tiny text config keys (coati_kto.testing.tiny's shapes), 32 wide."""
    if family == "gemma3":
        keys = dict(head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
        return dict(keys, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return dict(late_2026_shapes(VOCAB)[family][2], num_attention_heads=4)


def _model(family: str) -> transformers.PreTrainedModel:
    """A tiny ``...ForConditionalGeneration`` of ``family`` with a one-layer vision tower of the text's width out."""
    text = dict(_text(family), vocab_size=VOCAB, hidden_size=32, intermediate_size=64, pad_token_id=0)
    torch.manual_seed(0)
    if family == "gemma3":
        vision = transformers.SiglipVisionConfig(**TOWER, num_hidden_layers=1, image_size=28, patch_size=14)
        config = transformers.Gemma3Config(
            text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=IMAGE
        )
        model = transformers.Gemma3ForConditionalGeneration(config)
        # transformers starts the projector at zero (modeling_gemma3.py:427): the image would change nothing.
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    elif family == "gemma4":
        vision = transformers.Gemma4VisionConfig(
            **TOWER,
            num_hidden_layers=1,
            num_key_value_heads=2,
            head_dim=8,
            patch_size=4,
            pooling_kernel_size=2,
        )
        vision.position_embedding_size = 64
        config = transformers.Gemma4Config(
            text_config=text, vision_config=vision.to_dict(), image_token_id=IMAGE
        )
        model = transformers.Gemma4ForConditionalGeneration(config)
    else:
        vision = dict(
            TOWER,
            depth=1,
            num_heads=2,
            out_hidden_size=32,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE)
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    return model.eval()


def _image_inputs(family: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(image tokens, the tower's inputs for one image) as the family's processor shapes them."""
    gen = torch.Generator().manual_seed(1)
    if family == "gemma3":
        return 4, {"pixel_values": torch.randn(1, 3, 28, 28, generator=gen)}
    if family == "gemma4":
        from PIL import Image

        pixels = (torch.rand(32, 32, 3, generator=gen) * 255).to(torch.uint8).numpy()
        processor = transformers.Gemma4ImageProcessorPil(
            max_soft_tokens=70, patch_size=4, pooling_kernel_size=2
        )
        out = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
        return int(out["num_soft_tokens_per_image"][0]), {
            "pixel_values": out["pixel_values"],
            "image_position_ids": out["image_position_ids"],
        }
    grid = torch.tensor([[1, 4, 4]])  # 16 patches of 3 x 2 x 14 x 14, merged 2 x 2 into 4 tokens
    return 4, {"pixel_values": torch.randn(16, 1176, generator=gen), "image_grid_thw": grid}


def _rows(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An example and its KL pair: the same prompt (the image's tokens inside it), two completions, right-padded."""
    prompt = [2, 5, *[IMAGE] * tokens, 7, 8]
    rows = [prompt + [11, 12, 13], prompt + [14]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def _features(model: Any, family: str, image: dict[str, torch.Tensor]) -> Any:
    if family == "gemma3":
        return model.model.get_image_features(image["pixel_values"], return_dict=True)
    second = image["image_position_ids"] if family == "gemma4" else image["image_grid_thw"]
    return model.model.get_image_features(image["pixel_values"], second, return_dict=True)


def _both_rows(family: str, image: dict[str, torch.Tensor], features: Any) -> tuple[dict, Any]:
    """The two rows' tower inputs (the image twice) and the one image's features repeated for both rows."""
    twice = {k: torch.cat([v, v]) for k, v in image.items()}
    pooled = features.pooler_output
    features.pooler_output = torch.cat([pooled, pooled]) if family == "gemma3" else tuple(pooled) * 2
    return twice, features


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "qwen3_5"])
def test_one_images_features_give_the_pixel_values_logits_for_both_rows(family: str) -> None:
    model = _model(family)
    tokens, image = _image_inputs(family)
    ids, mask = _rows(tokens)
    types = (ids == IMAGE).long()
    text = {"token_type_ids": types} if family == "gemma3" else {"mm_token_type_ids": types}
    with torch.no_grad():
        twice, shared = _both_rows(family, image, _features(model, family, image))
        direct = model(input_ids=ids, attention_mask=mask, use_cache=False, **twice, **text).logits
        if family == "qwen3_5":  # its M-RoPE positions read the grid even when the features are given
            text["image_grid_thw"] = twice["image_grid_thw"]
        given = model(
            input_ids=ids, attention_mask=mask, use_cache=False, mm_encoder_outputs={"image": shared}, **text
        ).logits
        twice["pixel_values"] = twice["pixel_values"].flip(-1)  # another image, the same token count
        if family == "qwen3_5":
            del text["image_grid_thw"]
        other = model(input_ids=ids, attention_mask=mask, use_cache=False, **twice, **text).logits
    assert torch.equal(given, direct)
    # Not vacuous: another image moves the completion's logits (0.011 to 0.53 here; exactly 0 for Gemma 3 with
    # transformers' zero projector).
    assert (direct[:, -4:] - other[:, -4:]).abs().max() > 1e-3


def test_gemma4s_pad_row_read_feeds_nothing_when_input_ids_are_given() -> None:
    """modeling_gemma4.py:2385 reads ``embed_tokens.weight[pad_token_id]`` into the embeds it hands to
    ``get_per_layer_inputs``, which reads them only without ``input_ids``: dropped, the logits stay the same. A
    transformers that starts using them makes this fail, and the tensor-parallel policy must then gather the row."""
    model = _model("gemma4")
    tokens, image = _image_inputs("gemma4")
    ids, mask = _rows(tokens)
    twice = {k: torch.cat([v, v]) for k, v in image.items()}
    language = model.model.language_model
    original, seen = language.get_per_layer_inputs, []

    def without_embeds(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None) -> Any:
        seen.append(inputs_embeds is not None and input_ids is not None)
        return original(input_ids, None)

    with torch.no_grad():
        kept = model(input_ids=ids, attention_mask=mask, use_cache=False, **twice).logits
        language.get_per_layer_inputs = without_embeds
        try:
            dropped = model(input_ids=ids, attention_mask=mask, use_cache=False, **twice).logits
        finally:
            del language.get_per_layer_inputs
    assert seen == [True]  # the forward did hand the pad-row embeds over, with the ids
    assert torch.equal(dropped, kept)
