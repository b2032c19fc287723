"""The state of one micro-batch between the two phases of a KTO step (``coati_kto.trainer.passes``): what the
no-grad passes computed, and how its policy's KL log-probs arrive (phase 1, folded into or continued from the
gradient pass)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coati_kto.data.batch import KTOBatch, TokenCounts
from coati_kto.models.logit_means import LogitMeans


@dataclass
class NoGradPass:
    """One micro-batch's no-grad log-probs, [B] fp32 each, and its labels/validity.

    ``batch`` is kept only while its policy pass with gradient is pending (training), then dropped.
    """

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
    folded: bool = False  # the policy's KL pass runs inside its gradient pass (one packed pass)
    continued: bool = False  # the policy's KL pass continues from its gradient pass's KV cache
    aux: torch.Tensor | None = None  # evaluation only: the router loss over the valid examples' tokens (MoE)
    logits: LogitMeans | None = None  # what the policy's pass over the examples recorded (logits/ metrics)

    @property
    def kl_late(self) -> bool:
        """Whether the policy's KL log-probs come with its gradient pass (z0 then waits for that forward)."""
        return self.folded or self.continued
