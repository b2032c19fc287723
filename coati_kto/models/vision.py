"""A vision-language model's image features, computed once per batch and handed to every forward of the batch
(docs/image_feedback_plan.md §4).

The example view and its KL view hold the same prompts in the same rows, so the same images in the same order;
while the tower is frozen, one :func:`image_features` call serves both views, the policy and a reference of the
same weights. The forward then takes the features as ``mm_encoder_outputs`` (:func:`vision_keywords`, handed to
``coati_kto.models.lm_head.model_sequence_logps`` as its ``vision``) and gives exactly the logits of the
``pixel_values`` forward (tests/unit/models/test_vision_features.py).

What a batch must provide, per view (:class:`VisionInputs`; :func:`view_inputs` reads both from the collated
``KTOBatch.images``), for the families of :data:`VISION_FAMILIES`:
- ``pixel_values``: the batch's images in row order, as the family's image processor gives them (Gemma 3
  [N, 3, H, W]; Gemma 4 [N, P, 3·p²]; Qwen 3.5 [Σ patches, C]: dim 0 counts patches, not rows). Both views hold
  the same tensor.
- The tower's other input: Gemma 4's ``image_position_ids`` [N, P, 2] (-1 on padding patches), Qwen 3.5's
  ``image_grid_thw`` [N, 3], which its text part also reads (its M-RoPE positions, even with the features given).
- ``token_types`` [B, S] of the view, padded with 0: 1 on image tokens (Gemma 3's ``token_type_ids``, Gemma 4's and
  Qwen 3.5's ``mm_token_type_ids``). They make the image block bidirectional (Gemma) and place the M-RoPE
  positions (Qwen 3.5); the example and KL views differ in them after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from coati_kto.families import vision_language
from coati_kto.models.lora import base_module

if TYPE_CHECKING:
    from coati_kto.data.batch import ImageBatch


@dataclass(frozen=True)
class VisionFamily:
    """How one family's forward takes images: its token-type keyword, its tower's inputs beside
    ``pixel_values``, and those of them the text part reads too."""

    token_types: str
    tower_keys: tuple[str, ...] = ()
    text_keys: tuple[str, ...] = ()


# model type -> how its ...ForConditionalGeneration takes images (transformers 5.24, probed in the plan's §2).
VISION_FAMILIES: dict[str, VisionFamily] = {
    "gemma3": VisionFamily("token_type_ids"),
    "gemma4": VisionFamily("mm_token_type_ids", ("image_position_ids",)),
    "qwen3_5": VisionFamily("mm_token_type_ids", ("image_grid_thw",), ("image_grid_thw",)),
}


@dataclass(frozen=True)
class VisionInputs:
    """One view's vision inputs (the module docstring says what each holds); the family's extras, else None."""

    pixel_values: torch.Tensor
    token_types: torch.Tensor
    image_position_ids: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def view_inputs(images: ImageBatch) -> dict[str, VisionInputs]:
    """The example and KL views' inputs of a collated batch's images (``KTOBatch.images``): the same pixels and
    tower inputs, each view's token types."""
    shared = dict(
        pixel_values=images.pixel_values,
        image_position_ids=images.image_position_ids,
        image_grid_thw=images.image_grid_thw,
    )
    return {
        "example": VisionInputs(token_types=images.example_token_types, **shared),
        "kl": VisionInputs(token_types=images.kl_token_types, **shared),
    }


def vision_family(config: Any) -> VisionFamily:
    """How ``config``'s model takes images; ValueError naming the families that can, for any other model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in VISION_FAMILIES or not vision_language(config):
        raise ValueError(
            f"images need a vision-language model of {', '.join(VISION_FAMILIES)}; this one is {model_type!r}"
        )
    return VISION_FAMILIES[model_type]


def _extras(vision: VisionInputs, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``vision``'s tensors named ``keys``; ValueError naming any that is None."""
    out = {key: getattr(vision, key) for key in keys}
    missing = [key for key, value in out.items() if value is None]
    if missing:
        raise ValueError(f"the vision inputs lack {', '.join(missing)}, which this family's forward reads")
    return out


def tower_trainable(model: Any) -> bool:
    """Whether any parameter outside ``model``'s decoder and output embeddings (the vision tower, the projector)
    takes a gradient: not after ``coati_kto.models.hf.freeze_vision_tower``."""
    module = base_module(model)
    text = {id(p) for m in (module.get_decoder(), module.get_output_embeddings()) for p in m.parameters()}
    return any(p.requires_grad for p in module.parameters() if id(p) not in text)


def image_features(model: Any, vision: VisionInputs) -> Any:
    """The tower's features of ``vision``'s images (``get_image_features(..., return_dict=True)``: the output
    whose ``pooler_output`` the forward scatters into the image tokens), computed once for every view.

    No graph while the tower is frozen (:func:`tower_trainable`): the features are constants, and the tower and
    projector get no gradient. With a trainable tower they carry its graph, which one backward may go through.
    """
    module = base_module(model)
    family = vision_family(module.config)
    with torch.set_grad_enabled(torch.is_grad_enabled() and tower_trainable(module)):
        return module.get_image_features(
            vision.pixel_values, **_extras(vision, family.tower_keys), return_dict=True
        )


def vision_keywords(config: Any, vision: VisionInputs, features: Any) -> dict[str, Any]:
    """The forward keywords of one view: the shared ``features`` (:func:`image_features`), the view's token types
    and what the text part reads of the tower's inputs (Qwen 3.5's grid). A fresh mapping per call: transformers
    fills a given ``mm_encoder_outputs`` in place."""
    family = vision_family(config)
    return {
        "mm_encoder_outputs": {"image": features},
        family.token_types: vision.token_types,
        **_extras(vision, family.text_keys),
    }
