"""The scoring plan of a micro-batch: which passes score it and where its reference point z0 is reduced.

``ScoringRules`` holds what a run allows, decided once from the options, the models and the backend.
``ScoringRules.plan`` decides one ``ScoringPlan`` per micro-batch from the batch's host facts (its planned
layouts, its precomputed reference log-probs), whether a gradient pass follows (training) and whether its z0
group is that micro-batch alone. The step's passes (``coati_kto.trainer.passes``), in training and evaluation,
and the reference cache's scoring (``coati_kto.reference.scoring.score_rows``) read the plan; none
decides a path of its own.

The policy's KL log-probs (``ScoringPlan.policy_kl``):

- ``none``: the loss has no reference point (``apo_zero_unpaired``), so no KL pass runs;
- ``separate``: a pass of their own without gradient, before z0;
- ``packed``: evaluation only, one shared-prompt pass over the examples and their KL pairs (``pack_policy``);
- ``continued``: from the examples' KV cache (``kl_continuation``), in the gradient pass in training;
- ``folded``: training only, one packed pass with the gradient pass (``pack_policy`` where ``fold_pays``).

Training continues or folds only where the z0 group is one micro-batch: z0 then waits for that forward
(``z0 == "after_forward"``). Folding goes first where it pays, then continuing. Neither runs where the
policy's forward holds collectives (torch DDP): a rank would run its forward before the z0 all-reduce while a
peer runs it after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from coati_kto.data.batch import KTOBatch, PackedRows, RowSlice
from coati_kto.models.continuation import can_continue
from coati_kto.models.lora import AdapterFreeReference
from coati_kto.models.packing import can_pack

PolicyKL = Literal["none", "separate", "packed", "continued", "folded"]
# The reference's log-probs: the batch's precomputed ones, or its model on the examples alone (no KL pass), on
# both views in two passes, in one shared-prompt pass, or with the KL pairs continued from the examples' cache.
ReferencePath = Literal["cached", "examples", "separate", "packed", "continued"]
# Where z0 is reduced: nowhere (no reference point), once per group before the gradient passes, or between
# the one micro-batch's gradient forward and its backward.
Z0Place = Literal["none", "group", "after_forward"]
# Which model scores the reference passes: a model of its own, the LoRA policy with its adapters off, or none
# (every batch carries precomputed reference log-probs).
ReferenceModel = Literal["model", "adapters_off", "none"]


@dataclass(frozen=True)
class ScoringPlan:
    """The passes of one micro-batch; frozen, decided by :meth:`ScoringRules.plan`.

    ``example_rows`` / ``kl_rows``: the examples' / KL pairs' passes run on the collator's padding-free rows
    (not the padded view).
    """

    train: bool
    policy_kl: PolicyKL
    reference: ReferencePath
    reference_model: ReferenceModel
    z0: Z0Place
    example_rows: bool = False
    kl_rows: bool = False

    @property
    def kl_late(self) -> bool:
        """Whether the policy's KL log-probs come with its gradient pass (z0 then waits for that forward)."""
        return self.z0 == "after_forward"

    def rows(self, batch: KTOBatch, kl: bool) -> PackedRows | RowSlice | None:
        """The padding-free rows the plan runs the examples' or (``kl``) the KL pairs' pass on (this rank's slice
        of them under sequence parallelism), else None."""
        if kl:
            return batch.kl_rows if self.kl_rows else None
        return batch.example_rows if self.example_rows else None


@dataclass(frozen=True)
class ScoringRules:
    """What a run's scoring allows, decided once (:meth:`for_trainer`, :meth:`for_precompute`).

    needs_kl: the loss has a reference point (``kto``): the KL pairs are scored and z0 reduced.
    policy_packs: the policy's example and KL pair may share one packed pass (``pack_policy``, the loss mask
        on, a model :func:`~coati_kto.models.packing.can_pack` takes).
    folds: the policy's KL pass may fold into its gradient pass (it packs, and its forward holds no
        collectives).
    continues: the KL passes may continue from the examples' KV cache (``kl_continuation``, the loss mask on,
        no collectives in the forward, tp_size 1, policy and reference models that
        :func:`~coati_kto.models.continuation.can_continue`).

    Under sequence parallelism (``sp_size`` > 1) every pass runs on the collator's sliced rows: nothing packs
    the shared prompt (the pairs layout is not sliced) and nothing continues (its cache would hold one slice).
    pack_reference: the reference's example and KL pair share one pass (``pack_reference``, the loss mask on).
    reference_packs: the reference's shared-prompt pass is one packed row (else it falls back to two passes).
    padding_free: the collator's padding-free rows may be used (the loss mask on: rows score completions only).
    reference_model: which model scores the reference, if any.
    """

    needs_kl: bool
    policy_packs: bool = False
    folds: bool = False
    continues: bool = False
    pack_reference: bool = False
    reference_packs: bool = False
    padding_free: bool = True
    reference_model: ReferenceModel = "model"

    @classmethod
    def for_trainer(
        cls,
        options: Any,
        policy: Any,
        reference: Any,
        forward_collectives: bool,
        tp_size: int,
        apply_loss_mask: bool,
        sp_size: int = 1,
    ) -> ScoringRules:
        """The rules of a KTOTrainer's passes (``options``: its KTOOptions; ``forward_collectives``: the backend's
        forward holds collectives, torch DDP). ValueError (one line) for ``apply_loss_mask`` False under sequence
        parallelism: its passes run on the sliced padding-free rows, which score completion tokens only."""
        if sp_size > 1 and not apply_loss_mask:
            raise ValueError(
                f"apply_loss_mask=False with sp_size {sp_size}: sequence-parallel passes run on the sliced "
                "padding-free rows, which score the completion tokens only (sp_size 1 would score every token): "
                "set apply_loss_mask=True, or sp_size 1"
            )
        needs_kl = options.needs_kl
        whole = sp_size == 1  # every sequence-parallel pass runs on the sliced rows
        packs = needs_kl and options.pack_policy and apply_loss_mask and can_pack(policy) and whole
        models = [policy] + ([reference] if reference is not None else [])
        continues = (
            needs_kl
            and options.kl_continuation
            and apply_loss_mask
            and not forward_collectives
            and tp_size == 1
            and whole
            and all(can_continue(model) for model in models)
        )
        pack_reference = needs_kl and options.pack_reference and apply_loss_mask and whole
        if reference is None:
            reference_model: ReferenceModel = "none"
        else:
            reference_model = "adapters_off" if isinstance(reference, AdapterFreeReference) else "model"
        return cls(
            needs_kl=needs_kl,
            policy_packs=packs,
            folds=packs and not forward_collectives,
            continues=continues,
            pack_reference=pack_reference,
            reference_packs=pack_reference and reference is not None and can_pack(reference),
            padding_free=apply_loss_mask,
            reference_model=reference_model,
        )

    @classmethod
    def for_precompute(cls, model: Any, kl_continuation: bool, pack_policy: bool) -> ScoringRules:
        """The rules ``coati-kto precompute`` scores the reference ``model`` by: the KL pairs as the policy's
        training passes will score them where a z0 group is one micro-batch (folded where ``pack_policy``
        folds, else continued where ``model`` allows it, else one shared-prompt pass), so that step-1 KL is 0
        where the batches' shapes agree."""
        return cls(
            needs_kl=True,
            policy_packs=pack_policy,
            folds=pack_policy,
            continues=kl_continuation and can_continue(model),
            pack_reference=True,
            reference_packs=True,
        )

    def plan(self, batch: KTOBatch, train: bool, alone: bool = False) -> ScoringPlan:
        """The plan of ``batch`` (host facts only: nothing is read back from the device). ``train``: a gradient
        pass follows; ``alone``: its z0 group is this micro-batch only.

        Raises ValueError when the reference needs a model and there is none."""
        # A batch with images runs padded passes only: packed rows and the continuation take no images (their
        # masks and positions know no image block; docs/image_feedback_plan.md §4).
        padded = batch.images is not None
        late = train and alone and self.needs_kl and not padded  # the KL pass may run with the gradient pass
        # Folding first where it pays (long prompts, short completions: one pass, the KL completion's few tokens
        # through the backward), else continuing (two passes, the prompt once).
        folded = late and self.folds and batch.fold_pays
        # Evaluation continues wherever it may (no gradient pass to wait for), unless its passes pack.
        packs = self.needs_kl and self.policy_packs and not padded
        may_continue = (late and not folded) or (not train and not packs and self.needs_kl)
        continued = may_continue and batch.kl_continuation is not None and self.continues and not padded
        if not self.needs_kl:
            policy_kl: PolicyKL = "none"
        elif folded:
            policy_kl = "folded"
        elif continued:
            policy_kl = "continued"
        else:
            policy_kl = "packed" if not train and packs else "separate"
        return ScoringPlan(
            train=train,
            policy_kl=policy_kl,
            reference=self._reference(batch, continued, padded),
            reference_model=self.reference_model,
            z0="none"
            if not self.needs_kl
            else "after_forward"
            if folded or (train and continued)
            else "group",
            example_rows=self._uses_rows(batch.example_rows, batch),
            kl_rows=self._uses_rows(batch.kl_rows, batch),
        )

    def group_z0(self, plans: list[ScoringPlan]) -> bool:
        """Whether z0 is reduced once for the group of ``plans`` before its gradient passes: every rank enters
        that collective, also with an empty group."""
        return self.needs_kl and not any(plan.kl_late for plan in plans)

    def _reference(self, batch: KTOBatch, continued: bool, padded: bool) -> ReferencePath:
        """How the reference's log-probs of ``batch`` are had (see :data:`ReferencePath`)."""
        if batch.reference_logps is not None and (not self.needs_kl or batch.reference_kl_logps is not None):
            return "cached"
        if self.reference_model == "none":
            raise ValueError("no reference model and the batch has no precomputed reference_logps")
        if not self.needs_kl:
            return "examples"
        if continued:  # the policy's path, so step-1 KL is exactly 0
            return "continued"
        return "packed" if self.pack_reference and not padded else "separate"

    def _uses_rows(self, rows: PackedRows | RowSlice | None, batch: KTOBatch) -> bool:
        """Whether a pass runs on the collator's padding-free ``rows``: only with the loss mask, and only where
        they are fewer than the batch's rows. Bins of one document each are the padded rows again: the padded
        pass is the same work, with the model's own mask (rows are counted on the host, nothing read back).
        A sequence-parallel slice always runs (the padded view is not split)."""
        if isinstance(rows, RowSlice):
            return True
        return (
            rows is not None
            and batch.images is None
            and self.padding_free
            and rows.input_ids.shape[0] < len(batch)
        )
