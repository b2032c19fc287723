"""The ``kto`` section of the config: the loss, its reference point and how its passes run."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from coati_kto.config.section import Section as _Section
from coati_kto.config.section import auto_or_number, bool_or_auto

LossType = Literal["kto", "apo_zero_unpaired"]


class KTOSection(_Section):
    loss_type: LossType = Field(
        "kto", description="kto (Eq. 7, reference point z0) or apo_zero_unpaired (no z0, no KL passes)."
    )
    beta: float = Field(
        0.1, gt=0.0, description="Scale of the log-ratio in the sigmoid (higher: stay closer)."
    )
    desirable_weight: float = Field(1.0, gt=0.0, description="lambda_D: weight of desirable examples' loss.")
    undesirable_weight: float = Field(
        1.0, gt=0.0, description="lambda_U: weight of undesirable examples' loss."
    )
    auto_weights: bool = Field(False, description="Set the weights into the paper's [1, 4/3] guideline.")
    kl_scope: Literal["step", "micro_batch"] = Field(
        "step", description="z0 over the optimizer step, or per accumulation micro-batch (all ranks)."
    )
    reference: Literal["online", "cached"] = Field(
        "online",
        description="online: the reference model scores each batch; cached: its log-probs are computed once "
        "(coati-kto precompute) and stored with the prepared data, and training never loads it.",
    )
    precompute_batch_size: int = Field(16, ge=1, description="Rows per reference forward when precomputing.")
    pack_reference: bool = Field(
        False,
        description="Online reference: one shared-prompt pass per example and KL pair (equal within rounding, "
        "so step-0 rewards are ~0, not exactly 0). Refused with kto.reference cached (no reference pass runs) "
        "and with apo_zero_unpaired (no KL pair).",
    )
    pack_policy: bool | Literal["auto"] = Field(
        "auto",
        description="The policy's passes share the prompt too: evaluation in one packed pass; training folds the "
        "KL pass into the gradient pass when a z0 group is one micro-batch and prompts are long (3 x packed "
        "width <= KL width + 3 x example width). auto: on when the reference is cached or packed (step-0 "
        "rewards are then within rounding of 0 already). true is refused with apo_zero_unpaired (no KL pair).",
    )
    kl_continuation: bool = Field(
        True,
        description="Training: the policy's KL pass (and the online reference's) continues from the examples' "
        "KV cache, so the shared prompt runs once, where a z0 group is one micro-batch, rows are padded, the "
        "model attends fully (eager or sdpa, no window), with no checkpointing, compile or tensor parallelism; "
        "the separate KL pass elsewhere; a folding pack_policy first where folding pays. Evaluation: wherever the "
        "model allows (one z0 over the whole set, no group condition). Equal within rounding; step-1 KL exactly 0 "
        "(docs/performance.md).",
    )

    router_aux_loss_coef: float | Literal["auto"] = Field(
        "auto",
        description="MoE: weight of the router load-balancing loss added to the KTO loss (0: off). auto: the "
        "model's router_aux_loss_coef when its config sets output_router_logits (as transformers and TRL do).",
    )

    @field_validator("router_aux_loss_coef", mode="before")
    @classmethod
    def _auto_or_number(cls, value: Any) -> float | str:
        return auto_or_number(value)

    @field_validator("pack_policy", mode="before")
    @classmethod
    def _true_false_or_auto(cls, value: Any) -> bool | str:
        return bool_or_auto(value)

    def policy_packing(self) -> bool:
        """``pack_policy`` resolved: auto is on with a cached or packed reference."""
        if self.pack_policy == "auto":
            return self.reference == "cached" or self.pack_reference
        return bool(self.pack_policy)

    def _problems(self) -> list[str]:
        problems = []
        # Under a cached reference every batch carries its log-probs, read before any reference pass is planned
        # (ScoringRules._reference), and precompute packs its pairs whatever this says (ScoringRules.for_precompute).
        if self.pack_reference and self.reference == "cached":
            problems.append(
                "kto.pack_reference with kto.reference cached: no reference pass runs in training to pack (the "
                "cached log-probs are read, and precompute packs its pairs anyway); set kto.pack_reference=false, "
                "or kto.reference=online"
            )
        # Without a reference point no KL pair is scored: ScoringRules.for_trainer packs only where needs_kl, and
        # the auto pack_policy it turns on packs nothing either (policy_packs needs needs_kl too).
        if self.pack_reference and self.loss_type == "apo_zero_unpaired":
            problems.append(
                "kto.pack_reference with kto.loss_type apo_zero_unpaired: the loss has no reference point, so no KL "
                "pair is scored to share a pass with its example (the reference scores the examples alone); set "
                "kto.pack_reference=false, or kto.loss_type=kto"
            )
        # pack_policy packs the example with its KL pair (ScoringRules.for_trainer: packs needs needs_kl); auto
        # resolves to it where it could apply, so only an explicit true is a setting that does nothing here.
        if self.pack_policy is True and self.loss_type == "apo_zero_unpaired":
            problems.append(
                "kto.pack_policy true with kto.loss_type apo_zero_unpaired: the loss has no reference point, so no "
                "KL pair is scored for the policy's examples to share a pass with; set kto.pack_policy=auto, or "
                "kto.loss_type=kto"
            )
        return problems
