"""The images of the evaluation samples (issue 49, docs/image_feedback_plan.md §5): the prompts' pixels for
generation and for scoring the completions, and each sample's first image, down-scaled, for the logs.

Generation hands the pixels to transformers' ``generate`` (``coati_kto.models.generate.PromptImages``), which
gives them to the prefill forward only. Scoring computes each model's image features once and passes them as the
training passes do (``coati_kto.models.vision.vision_keywords``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from coati_kto.data.batch import TokenView
from coati_kto.data.images import open_image
from coati_kto.models.generate import PromptImages
from coati_kto.models.lora import base_module
from coati_kto.models.vision import VisionInputs, image_features, vision_keywords

LOGGED_SIDE = 256  # the longest side of a sample's image in TensorBoard and W&B, in pixels


@dataclass(frozen=True)
class SampleImages:
    """How the eval rows' images become model inputs: the collator's image processor, image token id and image
    table (``coati_kto.data.image_table.PreparedImages``: the bytes a row's ``images`` references)."""

    image_processor: Any
    image_token_id: int
    image_table: Any

    @classmethod
    def of(cls, collator: Any) -> SampleImages | None:
        """The image keywords of the eval loader's collator (``coati_kto.data.collator.KTOCollator``); None
        without an image processor (text records)."""
        processor = getattr(collator, "image_processor", None)
        if processor is None:
            return None
        return cls(processor, int(collator.image_token_id), collator.image_table)

    def prompt_images(self, rows: list[Any]) -> PromptImages | None:
        """Every row's images in row order through the image processor (None when no row has one)."""
        images = [open_image(image) for row in rows for image in self.image_table.row_images(row)]
        if not images:
            return None
        outputs = self.image_processor(images=images, return_tensors="pt")
        extras = {k: outputs[k] for k in ("image_position_ids", "image_grid_thw") if k in outputs}
        return PromptImages(outputs["pixel_values"], self.image_token_id, extras)

    def logged(self, row: Any) -> np.ndarray | None:
        """The row's first image as CHW uint8 RGB, its longest side at most :data:`LOGGED_SIDE` pixels (PIL's
        ``thumbnail``: the aspect ratio kept, never up-scaled); None for a row without images."""
        refs = row.get("images") or []
        return logged_image(self.image_table.bytes_of(refs[0])) if refs else None


def scoring_keywords(model: Any, images: PromptImages | None, view: TokenView) -> dict[str, Any] | None:
    """``model``'s forward keywords for one right-padded view of the sampled prompts and completions: its image
    features (one tower pass, no gradient) and the view's token types; None without images."""
    if images is None:
        return None
    types = ((view.input_ids == images.image_token_id) & view.attention_mask.bool()).long()
    device = view.input_ids.device
    vision = VisionInputs(
        pixel_values=images.pixel_values.to(device),
        token_types=types,
        **{k: v.to(device) for k, v in images.extras.items()},
    )
    with torch.no_grad():
        features = image_features(model, vision)
    return vision_keywords(base_module(model).config, vision, features)


def logged_image(image_bytes: bytes) -> np.ndarray:
    """``image_bytes`` as :meth:`SampleImages.logged` logs it."""
    image = open_image(image_bytes).convert("RGB")
    image.thumbnail((LOGGED_SIDE, LOGGED_SIDE))
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
