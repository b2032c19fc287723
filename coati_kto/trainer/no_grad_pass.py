"""One micro-batch between the two phases of a KTO step (``coati_kto.trainer.passes``): its scoring plan
(``coati_kto.trainer.scoring_plan``) and what the no-grad passes computed (``NoGradPass``), and the training
micro-batch handed to the trainer for its gradient pass and backward (``GradientPass``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from coati_kto.data.batch import KTOBatch, TokenCounts
from coati_kto.models.logit_means import LogitMeans
from coati_kto.trainer.scoring_plan import ScoringPlan
from coati_kto.trainer.shared_vision import SharedVision

# A training micro-batch's (losses, rewards, policy log-probs), [B] each.
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class NoGradPass:
    """One micro-batch's no-grad log-probs, [B] fp32 each, and its labels/validity.

    ``batch`` is kept only while its policy pass with gradient is pending (training), then dropped.
    """

    plan: ScoringPlan  # which passes score it, where its z0 is reduced
    batch: KTOBatch | None
    counts: TokenCounts  # the batch's tokens, counted on the host
    labels: torch.Tensor  # [B] bool
    valid: torch.Tensor  # [B] bool; False on evaluation padding rows
    tokens: int  # non-padding tokens of valid examples (and of their KL pairs, when run)
    gradient_tokens: int  # tokens the gradient pass processes (valid rows; packed if folded)
    flops: float  # model FLOPs of the no-grad passes run here (the continued KL pass's added with it)
    reference: torch.Tensor
    policy_kl: torch.Tensor | None  # None when the loss has no reference point (no KL passes run)
    reference_kl: torch.Tensor | None
    policy: torch.Tensor | None  # evaluation only: the policy's log-probs, computed without gradient
    aux: torch.Tensor | None = None  # evaluation only: the router loss over the valid examples' tokens (MoE)
    logits: LogitMeans | None = None  # what the policy's pass over the examples recorded (logits/ metrics)
    vision: SharedVision | None = None  # training: the batch's image features, kept for its gradient pass


@dataclass
class GradientPass:
    """A training micro-batch whose no-grad passes ran (``coati_kto.trainer.passes.KTOPasses.train_step``).

    ``loss()`` runs the policy's gradient pass (z0 reduced after its forward where the plan says so) and returns
    the loss the caller hands to backward, once, before taking the next micro-batch. ``last``: the step's last
    micro-batch, whose backward reduces the gradients.
    """

    last: bool
    plan: ScoringPlan
    run: Callable[[], tuple[torch.Tensor, Outputs]]
    outputs: Outputs | None = None  # set by loss(): what the step's sums record after the backward

    def loss(self) -> torch.Tensor:
        loss, self.outputs = self.run()
        return loss
