"""A micro-batch's image features, computed once and shared by its passes (issue 49, docs/image_feedback_plan.md
§4), and one padded view's completion log-probs as the step's passes score it.

The example view and its KL view hold prompt i in row i, so the same images in the same order: one
``get_image_features`` call (no gradient: the tower and projector are frozen, ``coati_kto.models.hf
.freeze_vision_tower``) serves both views, the policy's passes and the reference's where it holds the same
weights (no ``model.reference_path``). A reference of other weights computes its own, once.

With ``model.train_vision`` the policy's tower and projector take gradient: the no-grad passes use no-grad
features of the current policy weights, the gradient pass recomputes the example view's with a graph
(:func:`with_graph`; z0 is detached, so the KL view's pass needs none), and the reference computes its
own once, since its tower no longer equals the policy's after step 1. Policy and reference share only while the
tower is frozen.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from coati_kto.data.batch import KTOBatch, TokenView
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.lora import base_module
from coati_kto.models.packing import padded_logps
from coati_kto.models.vision import (
    VisionInputs,
    image_features,
    tower_trainable,
    view_inputs,
    vision_keywords,
)


@dataclass(frozen=True)
class SharedVision:
    """A micro-batch's vision inputs per view (``example``, ``kl``) and its image features per model (by id)."""

    inputs: dict[str, VisionInputs]
    features: dict[int, Any]

    def keywords(self, model: Any, kl: bool) -> dict[str, Any]:
        """The forward keywords of ``model`` on the examples or (``kl``) the KL pairs: a fresh mapping per call."""
        view = self.inputs["kl" if kl else "example"]
        return vision_keywords(base_module(model).config, view, self.features[id(model)])


def with_graph(vision: SharedVision | None, policy: Any) -> SharedVision | None:
    """``vision`` with ``policy``'s features recomputed under the caller's grad mode (the gradient pass: with the
    tower's graph where it takes gradient); ``vision`` itself where the tower is frozen or there are no images."""
    if vision is None or not tower_trainable(policy):
        return vision
    features = {**vision.features, id(policy): image_features(policy, vision.inputs["example"])}
    return SharedVision(vision.inputs, features)


def shared_vision(batch: KTOBatch, policy: Any, reference: Any, options: Any) -> SharedVision | None:
    """The no-grad features of ``batch``'s images (None without images): the policy's once, handed to the
    reference too where ``options.reference_is_policy_weights`` (it loads ``model.path``) and the policy's tower is
    frozen, else the reference's own (``options`` is read only with a reference). A trainable tower's gradient
    pass adds its graph (:func:`with_graph`)."""
    if batch.images is None:
        return None
    inputs = view_inputs(batch.images)
    with torch.no_grad():
        features = {id(policy): image_features(policy, inputs["example"])}
        if reference is not None and id(reference) not in features:
            shared = options.reference_is_policy_weights and not tower_trainable(policy)
            features[id(reference)] = (
                features[id(policy)] if shared else image_features(reference, inputs["example"])
            )
    return SharedVision(inputs, features)


def view_logps(
    model: Any,
    view: TokenView,
    head: LMHead | None,
    apply_loss_mask: bool,
    vision: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Completion log-probs [B] fp32 of ``model`` on one padded view (graph only under grad), with the view's
    image keywords (``SharedVision.keywords``) where it has images. ``apply_loss_mask`` False scores every
    non-padding token (prompt included), as ColossalChat does."""
    if not apply_loss_mask:
        mask = view.attention_mask
        return model_sequence_logps(model, view.input_ids, mask, mask, head, vision=vision)
    return padded_logps(model, view, head, vision)
