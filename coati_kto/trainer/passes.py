"""The passes of one KTO step over its micro-batches: no-grad log-probs, the reference point z0, the policy's
gradient pass and the loss (``KTOPasses.forward``), shared by training and evaluation.

Per micro-batch: phase 1 (no grad) scores the reference on the examples and their KL pairs (two passes, or
one shared-prompt pass: coati_kto.models.packing; or the batch's precomputed ``reference_logps``) and the
policy on the KL pairs; z0 is reduced over the data-parallel group once per group of micro-batches (every
rank enters that collective whatever its labels); phase 2 runs the policy with gradient and the KTO loss, and
hands the loss to ``backward`` (with an MoE's router load-balancing loss over the examples' tokens of that
pass, ``coati_kto.models.router``, where ``kto.router_aux_loss_coef`` adds it). A group of one training
micro-batch may instead run the policy's KL pass from its gradient pass, z0 then reduced between that forward
and its backward: continuing from the forward's KV cache (``kl_continuation``; the online reference continues
its own examples' pass too, so both score the same way), or folded into it as one packed row (``pack_policy``).

Every rank calls ``forward`` with the same number of groups; per-model facts (the chunked LM head, the FLOPs
parameter count) are computed once per model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from coati_kto.data.batch import KTOBatch, PackedRows, TokenCounts, TokenView
from coati_kto.data.packed import count_tokens
from coati_kto.models.continuation import (
    can_continue,
    continued_kl_logps,
    continued_logps,
    example_logps_with_cache,
)
from coati_kto.models.lm_head import LMHead, model_sequence_logps
from coati_kto.models.logit_means import LogitMeans, recording
from coati_kto.models.packing import can_pack, example_tokens, packed_logps, padded_logps, pair_logps
from coati_kto.models.router import RouterLoss
from coati_kto.parallel.distributed import mean_over_group
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.trainer.loss import estimate_kl_raw, preference_loss
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.no_grad_pass import NoGradPass
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.throughput import flop_params, forward_flops, train_flops


class KTOPasses:
    """The policy's and the reference's passes of a KTO step, and the loss. Every rank builds one (KTOTrainer).

    ``reference`` may be None when every batch carries precomputed reference log-probs. ``kl_group`` is the
    process group z0 reduces over (the data-parallel group; ``ParallelPlan.kl_group``).
    """

    def __init__(
        self,
        policy: Any,
        reference: Any,
        plan: ParallelPlan,
        options: KTOOptions,
        kl_group: Any,
        device: torch.device,
        loss_weights: tuple[float, float, float],
        apply_loss_mask: bool = True,
    ) -> None:
        self.policy, self.reference, self.plan, self.options = policy, reference, plan, options
        self.kl_group, self.device = kl_group, device
        self.beta, self.desirable_weight, self.undesirable_weight = loss_weights
        self.apply_loss_mask = apply_loss_mask
        self._needs_kl = options.needs_kl
        self._policy_packing: bool | None = None
        self._continuing: bool | None = None
        self._heads: dict[int, LMHead | None] = {}  # per model: its chunked LM head, or None
        self._params: dict[int, int] = {}  # per model: N for the model FLOPs count
        # The policy's router load-balancing loss (MoE, kto.router_aux_loss_coef), or None: nothing added.
        self._router = RouterLoss.find(policy, options.router_aux_loss_coef)

    def forward(
        self,
        groups: Iterable[Iterable[KTOBatch]],
        train: bool,
        num_micro_batches: int = 1,
        backward: Callable[[torch.Tensor], None] | None = None,
        grad_sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    ) -> StepSums:
        """Run every micro-batch of ``groups``; one reference point z0 per group. ``backward(loss)`` when ``train``.

        Phase 1 (no grad) runs over a whole group before z0 exists; phase 2 needs z0. In evaluation the policy
        log-probs come from phase 1 and batches are dropped at once, so a whole eval set can be one group.
        A group of one training micro-batch may fold the policy's KL pass into its gradient pass (one packed
        pass, ``pack_policy``): z0 is then reduced between that forward and its backward, still once per group
        on every rank, folded or not.
        """
        sums = StepSums(self.device)
        done = 0
        if train:
            groups = [list(group) for group in groups]
            # Every example of the step weighs the same, 1 / (the step's rows on all data-parallel ranks), also
            # when micro-batches differ in size (a step re-planned after a resume on another layout): the
            # plugins average gradients over the dp ranks, so each rank divides by (global rows / dp size).
            rows = sum(len(batch) for group in groups for batch in group)
            scale = mean_over_group(float(rows), self.kl_group, self.device)
        for group in groups:
            group = list(group)
            passes = [self._no_grad_pass(batch, train, may_fold=len(group) == 1) for batch in group]
            folded = bool(passes) and passes[0].kl_late  # only a group of one micro-batch folds or continues
            z0 = self._z0(passes, sums) if self._needs_kl and not folded else None
            for item in passes:
                done += 1
                last = done == num_micro_batches
                with grad_sync(last) if train and grad_sync else contextlib.nullcontext():
                    policy_logps, aux = self._policy_pass(item) if train else (item.policy, None)
                    if item.kl_late:
                        z0 = self._z0([item], sums)
                    losses, rewards = preference_loss(
                        self.options.loss_type,
                        policy_logps,
                        item.reference,
                        item.labels,
                        z0,
                        self.beta,
                        self.desirable_weight,
                        self.undesirable_weight,
                    )
                    if train:
                        backward(self._train_loss(losses, item, aux, scale, sums))
                    elif item.aux is not None:  # weighed by the valid rows, as training weighs its rows
                        sums.add_aux(item.aux, item.valid.sum())
                item.batch = None
                grad_flops = train_flops(self._flop_params(self.policy), item.gradient_tokens) if train else 0
                sums.add_host(tokens=item.tokens, flops=item.flops + grad_flops)
                sums.add(losses, rewards, policy_logps, item.labels, item.valid, item.logits)
        return sums

    def _train_loss(
        self,
        losses: torch.Tensor,
        item: NoGradPass,
        aux: torch.Tensor | None,
        scale: torch.Tensor,
        sums: StepSums,
    ) -> torch.Tensor:
        """The loss handed to backward: the micro-batch's KTO losses [B] over the step's rows (``scale``), plus its
        router load-balancing loss (recorded in ``sums``) x the coefficient, weighing its rows as its examples
        do: with equal micro-batches, the mean of every pass's router loss over the step's micro-batches and
        data-parallel ranks, as transformers' Trainer averages it under accumulation and DDP."""
        loss = torch.where(item.valid, losses, 0.0).sum() / scale
        if aux is None:
            return loss
        sums.add_aux(aux, len(item.batch))
        return loss + self._router.coefficient * aux * (len(item.batch) / scale)

    def _z0(self, passes: list[NoGradPass], sums: StepSums) -> torch.Tensor:
        """z0 of a group (one collective); recorded with its unclamped value."""
        raw = self._reference_point(passes)
        z0 = raw.clamp(min=0.0)  # the paper's clamp, after averaging; raw is logged beside it
        sums.add_kl(z0, raw)
        return z0

    def _no_grad_pass(self, batch: KTOBatch, train: bool, may_fold: bool = False) -> NoGradPass:
        """The reference's log-probs and the policy's without gradient: on the KL pairs (unless the KL pass
        folds into the gradient pass) and, in evaluation, on the examples (one packed pass with
        ``pack_policy``)."""
        counts = batch.counts or count_tokens(batch)  # a batch built without the collator: counted here
        batch = batch.to(self.device, non_blocking=True)
        labels = batch.label.bool()
        valid = batch.valid_rows()
        kl_tokens = counts.kl if self._needs_kl else 0  # apo_zero_unpaired: no pass runs on the KL pairs
        packs = self._needs_kl and self._policy_packs()
        late = train and may_fold and self._needs_kl  # the KL pass may run with the gradient pass
        # Folding first where it pays (long prompts, short completions: one pass, the KL completion's few tokens
        # through the backward), else continuing (two passes, the prompt once).
        folded = late and packs and batch.fold_pays and not self.plan.backend.forward_collectives
        # Evaluation continues wherever it may (no gradient pass to wait for), unless its passes pack.
        continues = (late and not folded) or (not train and not packs and self._needs_kl)
        continued = continues and batch.kl_continuation is not None and self._continues()
        with torch.no_grad():
            reference, reference_kl, ran = self._reference_pair(batch, counts, self._needs_kl, continued)
            # Model FLOPs of the passes that run: the reference unless the batch carries its log-probs, and
            # the policy's no-grad passes (a packed pass counts the shared prompt once).
            flops = forward_flops(self._flop_params(self.reference), ran) if ran else 0.0
            routing = self._router.capture() if self._router is not None and not train else None
            # Evaluation's pass over the examples records the policy's logit means (training's gradient pass does).
            with (
                routing or contextlib.nullcontext() as routed,
                recording(None if train else LogitMeans()) as means,
            ):
                policy, policy_kl, run = self._policy_no_grad(batch, counts, train, packs, folded, continued)
            flops += forward_flops(self._flop_params(self.policy), run) if run else 0.0
        return NoGradPass(
            batch=batch if train else None,
            counts=counts,
            labels=labels,
            valid=valid,
            tokens=counts.example + kl_tokens,
            gradient_tokens=counts.example + kl_tokens if folded else counts.example,
            flops=flops,
            reference=reference,
            policy_kl=policy_kl,
            reference_kl=reference_kl,
            policy=policy,
            folded=folded,
            continued=continued and train,  # evaluation has no gradient pass to continue in
            aux=self._eval_aux(routed, batch, valid, packs) if routing is not None else None,
            logits=means,
        )

    def _policy_no_grad(
        self, batch: KTOBatch, counts: TokenCounts, train: bool, packs: bool, folded: bool, continued: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """The policy's no-grad passes: (examples' log-probs [B] in evaluation else None, KL pairs' [B] unless the
        gradient pass gives them, tokens the valid rows ran); inside the evaluation's router capture."""
        if train:  # the gradient pass gives the KL pairs' log-probs when folded or continued
            if folded or continued or not self._needs_kl:
                return None, None, 0
            return None, self._view_logps(self.policy, batch, kl=True), counts.kl
        kl = counts.kl if self._needs_kl else 0
        if packs:
            policy, policy_kl, _ = pair_logps(self.policy, batch)
            return policy, policy_kl, counts.example - counts.pairs_shared + kl
        if not continued:
            with self._unrecorded():
                policy_kl = self._view_logps(self.policy, batch, kl=True) if self._needs_kl else None
            return self._view_logps(self.policy, batch, kl=False), policy_kl, counts.example + kl
        policy, cache = example_logps_with_cache(self.policy, batch.example, self._lm_head(self.policy))
        policy_kl = self._continued_kl(batch, cache)
        return policy, policy_kl, counts.example + counts.continuation

    def _continued_kl(self, batch: KTOBatch, cache: Any) -> torch.Tensor:
        """The policy's KL log-probs [B] from ``cache`` (its examples' pass), unseen by a router capture."""
        cached, head = batch.example.input_ids.shape[1], self._lm_head(self.policy)
        with self._unrecorded():
            return continued_kl_logps(self.policy, cache, cached, batch.kl_continuation, head)

    @contextlib.contextmanager
    def _unrecorded(self) -> Iterator[None]:
        """Within: the policy's forwards record no router logits and no logit means (KL passes: no router loss
        and no logits/ metric reads them)."""
        with recording(None), self._router.paused() if self._router is not None else contextlib.nullcontext():
            yield

    def _eval_aux(
        self, routed: list[torch.Tensor], batch: KTOBatch, valid: torch.Tensor, packed: bool
    ) -> torch.Tensor:
        """The router loss of an evaluation pass of the policy over the examples (``packed``: with their KL pairs,
        over ``batch.pairs``), over the valid rows' example tokens only (evaluation padding counts nowhere)."""
        if packed:
            tokens = example_tokens(self.policy, batch.pairs, valid)
        else:
            rows = self._packed_rows(batch, kl=False)
            mask = batch.example.attention_mask * valid[:, None]
            tokens = mask if rows is None else example_tokens(self.policy, rows, valid)
        return self._router.loss(routed, tokens)

    def _policy_packs(self) -> bool:
        """Whether the policy's passes pack example and KL pair (``pack_policy``, the loss mask on, and a model
        :func:`~coati_kto.models.packing.can_pack` takes); decided once."""
        if self._policy_packing is None:
            self._policy_packing = self.options.pack_policy and self.apply_loss_mask and can_pack(self.policy)
        return self._policy_packing

    def _continues(self) -> bool:
        """Whether the KL passes may continue from the examples' cache (``kto.kl_continuation``, the loss mask
        on, no collectives inside the forward, tp_size 1 (a sharded forward's cache is not tested), policy and
        reference models that :func:`~coati_kto.models.continuation.can_continue`); decided once."""
        if self._continuing is None:
            models = [self.policy] + ([self.reference] if self.reference is not None else [])
            self._continuing = (
                self.options.kl_continuation
                and self.apply_loss_mask
                and not self.plan.backend.forward_collectives
                and self.plan.tp_size == 1
                and all(can_continue(model) for model in models)
            )
        return self._continuing

    def _reference_point(self, passes: list[NoGradPass]) -> torch.Tensor:
        """The unclamped KL estimate over the valid KL pairs of ``passes`` on every data-parallel rank (one
        collective); z0 is its max with 0."""
        if not passes:  # still enter the collective: the other ranks do
            empty = torch.zeros(0, device=self.device)
            return estimate_kl_raw(empty, empty, group=self.kl_group)
        policy_kl = torch.cat([p.policy_kl for p in passes])
        reference_kl = torch.cat([p.reference_kl for p in passes])
        valid = torch.cat([p.valid for p in passes])
        return estimate_kl_raw(policy_kl, reference_kl, group=self.kl_group, valid=valid)

    def _policy_pass(self, item: NoGradPass) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The policy's gradient pass: (completion log-probs [B] fp32, its router load-balancing loss, fp32 0-dim
        over the examples' tokens, or None when none is added). Folded: the packed pass also gives the KL
        pairs' log-probs (set on ``item``) and its KL tokens are left out of the router loss."""
        routing = self._router.capture() if self._router is not None else contextlib.nullcontext()
        with routing as routed, recording(LogitMeans()) as item.logits:  # its KL passes record nothing
            if item.folded:
                policy_logps, item.policy_kl, _ = pair_logps(self.policy, item.batch)
                item.gradient_tokens -= item.counts.pairs_shared
            elif item.continued:
                head = self._lm_head(self.policy)
                policy_logps, cache = example_logps_with_cache(self.policy, item.batch.example, head)
                item.policy_kl = self._continued_kl(item.batch, cache)
                item.flops += forward_flops(self._flop_params(self.policy), item.counts.continuation)
            else:
                policy_logps = self._view_logps(self.policy, item.batch, kl=False)  # the only graph built
        if routed is None:
            return policy_logps, None
        if item.folded:  # folding needs the collator's pairs (fold_pays is computed from them)
            tokens = example_tokens(self.policy, item.batch.pairs)
        else:
            rows = self._packed_rows(item.batch, kl=False)
            tokens = item.batch.example.attention_mask if rows is None else example_tokens(self.policy, rows)
        return policy_logps, self._router.loss(routed, tokens)

    def _reference_pair(
        self, batch: KTOBatch, counts: TokenCounts, kl: bool = True, continued: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(reference log-probs [B], on the KL pairs [B] or None when ``kl`` is False, tokens of the valid rows
        the reference processed): precomputed from the batch (0 tokens), else the KL pass continuing the
        examples' (``continued``: the policy's path, so step-1 KL is exactly 0), one shared-prompt pass
        (coati_kto.models.packing: the shared prompt once), or the examples alone without ``kl``."""
        if batch.reference_logps is not None and (not kl or batch.reference_kl_logps is not None):
            reference_kl = batch.reference_kl_logps.float() if kl else None
            return batch.reference_logps.float(), reference_kl, 0
        if self.reference is None:
            raise ValueError("no reference model and the batch has no precomputed reference_logps")
        if not kl:
            return self._view_logps(self.reference, batch, kl=False), None, counts.example
        both = counts.example + counts.kl
        if continued:
            head, continuation = self._lm_head(self.reference), batch.kl_continuation
            example, kl_logps = continued_logps(self.reference, batch.example, continuation, head)
            return example, kl_logps, both - counts.continuation_visible
        if not self.apply_loss_mask or not self.options.pack_reference:  # two passes (or every token scored)
            example, kl_logps = (self._view_logps(self.reference, batch, kl=view) for view in (False, True))
            return example, kl_logps, both
        example, kl_logps, _ = pair_logps(self.reference, batch)
        return example, kl_logps, both - (counts.pairs_shared if can_pack(self.reference) else 0)

    def _view_logps(self, model: Any, batch: KTOBatch, kl: bool) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on the examples or (``kl``) the KL pairs: from the
        collator's padding-free rows when it planned fewer rows than documents (coati_kto.data.packed), else the
        padded view."""
        rows = self._packed_rows(batch, kl)
        if rows is None:
            return self._sequence_logps(model, batch.kl if kl else batch.example)
        if not can_pack(model):
            raise RuntimeError(
                "data.padding_free: this model cannot take packed rows (it needs eager, sdpa or flex attention, "
                "4D masks that reproduce its layers' windows, and a plain LM head)"
            )
        example, kl_logps = packed_logps(model, self._lm_head(model), rows, len(batch))
        return kl_logps if kl else example

    def completion_logps(self, model: Any, view: TokenView) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on ``view``, as the eval passes score them (evaluation
        samples); every rank of a tensor-parallel group calls with the same view."""
        return self._sequence_logps(model, view)

    def _packed_rows(self, batch: KTOBatch, kl: bool) -> PackedRows | None:
        """The collator's padding-free rows for the examples or (``kl``) the KL pairs, None for the padded view."""
        rows = batch.kl_rows if kl else batch.example_rows
        # Bins that hold one document each are the padded rows again: the padded pass is the same work, with
        # the model's own mask (rows are counted on the host, nothing is read back).
        if rows is None or not self.apply_loss_mask or rows.input_ids.shape[0] >= len(batch):
            return None
        return rows

    def _sequence_logps(self, model: Any, view: TokenView) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on one view of the batch (graph only under grad)."""
        # apply_loss_mask=False scores every non-padding token (prompt included), as ColossalChat does.
        if not self.apply_loss_mask:
            return model_sequence_logps(
                model, view.input_ids, view.attention_mask, view.attention_mask, self._lm_head(model)
            )
        return padded_logps(model, view, self._lm_head(model))

    def _flop_params(self, model: Any) -> int:
        """N of ``model`` for the FLOPs count (coati_kto.trainer.throughput), computed once per model."""
        if id(model) not in self._params:
            self._params[id(model)] = flop_params(model)
        return self._params[id(model)]

    def _lm_head(self, model: Any) -> LMHead | None:
        """The model's LM head for the chunked path (no [B, S, V] logits), or None: the logits path.

        A backend whose parameters are not resident in the forward uses the head through logits.
        """
        if id(model) not in self._heads:
            resident = self.plan.backend.chunked_head
            self._heads[id(model)] = LMHead.find(model) if resident else None
        return self._heads[id(model)]
