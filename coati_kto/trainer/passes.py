"""The passes of one KTO step over its micro-batches: no-grad log-probs, the reference point z0, the policy's
gradient pass and the loss, shared by training (``KTOPasses.train_step``) and evaluation (``KTOPasses.evaluate``).

Each micro-batch's passes follow its scoring plan (``coati_kto.trainer.scoring_plan``), decided once from the
batch, the options and the models. Phase 1 (no grad) scores the reference on the examples and their KL pairs
(or takes the batch's precomputed ``reference_logps``) and the policy on the KL pairs; z0 is reduced over the
data-parallel group once per group of micro-batches (every rank enters that collective whatever its labels);
phase 2 runs the policy with gradient and the KTO loss (with an MoE's router load-balancing loss over the
examples' tokens of that pass, ``coati_kto.models.router``, where ``kto.router_aux_loss_coef`` adds it). A group
of one training micro-batch may instead score the policy's KL pairs in its gradient pass, z0 then reduced
between that forward and its backward: continued from the forward's KV cache, or folded into it as one packed
row.

The trainer owns backward and the gradient synchronisation: ``train_step`` yields each micro-batch as a
``GradientPass`` whose ``loss()`` the trainer backward()s. Every rank runs the same number of groups;
per-model facts (the chunked LM head, the FLOPs parameter count) are computed once per model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from coati_kto.data.batch import KTOBatch, RowSlice, TokenCounts, TokenView
from coati_kto.data.packed import count_tokens
from coati_kto.models.continuation import (
    continued_kl_logps,
    continued_logps,
    example_logps_with_cache,
)
from coati_kto.models.lm_head import LMHead
from coati_kto.models.logit_means import LogitMeans, recording
from coati_kto.models.packing import can_pack, example_tokens, packed_logps, pair_logps
from coati_kto.models.router import RouterLoss
from coati_kto.models.sequence_packing import sp_packed_logps
from coati_kto.parallel.distributed import mean_over_group
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.trainer.loss import estimate_kl_raw, preference_loss
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.no_grad_pass import GradientPass, NoGradPass, Outputs
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.scoring_plan import ScoringPlan, ScoringRules
from coati_kto.trainer.shared_vision import SharedVision, shared_vision, view_logps, with_graph
from coati_kto.trainer.throughput import FlopParams, flop_params


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
    ) -> None:
        self.policy, self.reference, self.plan, self.options = policy, reference, plan, options
        self.kl_group, self.device = kl_group, device
        self._rules: ScoringRules | None = None
        self._heads: dict[int, LMHead | None] = {}  # per model: its chunked LM head, or None
        self._params: dict[int, FlopParams] = {}  # per model: N for the model FLOPs count
        # The policy's router load-balancing loss (MoE, kto.router_aux_loss_coef), or None: nothing added.
        self._router = RouterLoss.find(policy, options.router_aux_loss_coef)

    @property
    def rules(self) -> ScoringRules:
        """What this run's scoring allows: decided once, at the first batch (the models are built by then)."""
        if self._rules is None:
            self._rules = ScoringRules.for_trainer(
                self.options,
                self.policy,
                self.reference,
                self.plan.backend.forward_collectives,
                self.plan.tp_size,
                self.options.apply_loss_mask,
                self.plan.sp_size,
            )
        return self._rules

    def scoring_plan(self, batch: KTOBatch, train: bool, alone: bool = False) -> ScoringPlan:
        """The passes of ``batch`` (``alone``: its z0 group is this training micro-batch only)."""
        return self.rules.plan(batch, train, alone)

    def train_step(self, groups: Iterable[Iterable[KTOBatch]], sums: StepSums) -> Iterator[GradientPass]:
        """The training micro-batches of ``groups`` in order, each after its group's no-grad passes and z0 (one per
        group): the caller backward()s each one's ``loss()`` before taking the next; ``sums`` gets each micro-batch's
        metrics after its backward.

        Every example of the step weighs the same, 1 / (the step's rows on all data-parallel ranks), also when
        micro-batches differ in size (a step re-planned after a resume on another layout): the plugins average
        gradients over the dp ranks, so each rank divides by (global rows / dp size).
        """
        groups = [list(group) for group in groups]
        total = sum(len(group) for group in groups)
        rows = sum(len(batch) for group in groups for batch in group)
        scale = mean_over_group(float(rows), self.kl_group, self.device)
        done = 0
        for group in groups:
            items = [
                self._no_grad_pass(batch, self.scoring_plan(batch, True, len(group) == 1)) for batch in group
            ]
            z0 = self._z0(items, sums) if self.rules.group_z0([item.plan for item in items]) else None
            for item in items:
                done += 1
                micro = GradientPass(
                    done == total, item.plan, functools.partial(self._gradient_loss, item, z0, scale, sums)
                )
                yield micro
                if micro.outputs is None:
                    raise RuntimeError("KTOPasses.train_step: a micro-batch's loss() was not taken")
                self._record(item, sums, *micro.outputs)

    def evaluate(self, batches: Iterable[KTOBatch]) -> StepSums:
        """The sums of ``batches`` without gradient, one z0 over all of them: the policy's log-probs come from
        phase 1 and each batch is dropped at once, so a whole eval set is one group."""
        sums = StepSums(self.device, evaluation=True)
        items = [self._no_grad_pass(batch, self.scoring_plan(batch, False)) for batch in batches]
        z0 = self._z0(items, sums) if self.rules.group_z0([item.plan for item in items]) else None
        for item in items:
            losses, rewards = self._loss(item.policy, item, z0)
            if item.aux is not None:  # weighed by the valid rows, as training weighs its rows
                sums.add_aux(item.aux, item.valid.sum())
            self._record(item, sums, losses, rewards, item.policy)
        return sums

    def _gradient_loss(
        self, item: NoGradPass, z0: torch.Tensor | None, scale: torch.Tensor, sums: StepSums
    ) -> tuple[torch.Tensor, Outputs]:
        """The policy's gradient pass over ``item``, z0 reduced after its forward where the plan says so, and the
        loss to hand to backward, with the micro-batch's (losses, rewards, policy log-probs)."""
        policy_logps, aux = self._policy_pass(item)
        if item.plan.kl_late:
            z0 = self._z0([item], sums)
        losses, rewards = self._loss(policy_logps, item, z0)
        return self._train_loss(losses, item, aux, scale, sums), (losses, rewards, policy_logps)

    def _loss(
        self, policy_logps: torch.Tensor, item: NoGradPass, z0: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example (losses, rewards) [B] of the run's loss type."""
        return preference_loss(
            self.options.loss_type,
            policy_logps,
            item.reference,
            item.labels,
            z0,
            self.options.beta,
            self.options.desirable_weight,
            self.options.undesirable_weight,
        )

    def _record(
        self,
        item: NoGradPass,
        sums: StepSums,
        losses: torch.Tensor,
        rewards: torch.Tensor,
        policy_logps: torch.Tensor,
    ) -> None:
        """Add a finished micro-batch to ``sums`` (its tokens and model FLOPs counted on the host); drop its batch."""
        item.batch = item.vision = None
        train = item.plan.train
        grad_flops = self._flop_params(self.policy).train(item.gradient_tokens) if train else 0
        sums.add_host(tokens=item.tokens, flops=item.flops + grad_flops)
        sums.add(losses, rewards, policy_logps, item.labels, item.valid, item.logits)

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

    def _no_grad_pass(self, batch: KTOBatch, plan: ScoringPlan) -> NoGradPass:
        """The reference's log-probs and the policy's without gradient, as ``plan`` says: on the KL pairs (unless
        the gradient pass scores them) and, in evaluation, on the examples."""
        counts = batch.counts or count_tokens(batch)  # a batch built without the collator: counted here
        batch = batch.to(self.device, non_blocking=True)
        labels = batch.label.bool()
        valid = batch.valid_rows()
        kl_tokens = counts.kl if plan.policy_kl != "none" else 0  # apo_zero_unpaired: no pass on the KL pairs
        train = plan.train
        with torch.no_grad():
            # A batch's image features, once for all its passes (coati_kto.trainer.shared_vision).
            vision = shared_vision(batch, self.policy, self.reference, self.options)
            reference, reference_kl, ran = self._reference_pair(batch, counts, plan, vision)
            # Model FLOPs of the passes that run: the reference unless the batch carries its log-probs, and
            # the policy's no-grad passes (a packed pass counts the shared prompt once).
            flops = self._flop_params(self.reference).forward(ran) if ran else 0.0
            routing = self._router.capture() if self._router is not None and not train else None
            # Evaluation's pass over the examples records the policy's logit means (training's gradient pass does).
            with (
                routing or contextlib.nullcontext() as routed,
                recording(None if train else LogitMeans()) as means,
            ):
                policy, policy_kl, run = self._policy_no_grad(batch, counts, plan, vision)
            flops += self._flop_params(self.policy).forward(run) if run else 0.0
        return NoGradPass(
            plan=plan,
            batch=batch if train else None,
            counts=counts,
            labels=labels,
            valid=valid,
            tokens=counts.example + kl_tokens,
            gradient_tokens=counts.example + kl_tokens if plan.policy_kl == "folded" else counts.example,
            flops=flops,
            reference=reference,
            policy_kl=policy_kl,
            reference_kl=reference_kl,
            policy=policy,
            aux=self._eval_aux(routed, batch, valid, plan) if routing is not None else None,
            logits=means,
            vision=vision if train else None,
        )

    def _policy_no_grad(
        self, batch: KTOBatch, counts: TokenCounts, plan: ScoringPlan, vision: SharedVision | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
        """The policy's no-grad passes: (examples' log-probs [B] in evaluation else None, KL pairs' [B] unless the
        gradient pass gives them, tokens the valid rows ran); inside the evaluation's router capture."""
        if plan.train:  # the gradient pass gives the KL pairs' log-probs when folded or continued
            if plan.policy_kl != "separate":
                return None, None, 0
            return None, self._view_logps(self.policy, batch, plan, True, vision), counts.kl
        kl = counts.kl if plan.policy_kl != "none" else 0
        if plan.policy_kl == "packed":
            policy, policy_kl, _ = pair_logps(self.policy, batch)
            return policy, policy_kl, counts.example - counts.pairs_shared + kl
        if plan.policy_kl != "continued":
            with self._unrecorded():
                separate = plan.policy_kl == "separate"
                policy_kl = self._view_logps(self.policy, batch, plan, True, vision) if separate else None
            return self._view_logps(self.policy, batch, plan, False, vision), policy_kl, counts.example + kl
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
        self, routed: list[torch.Tensor], batch: KTOBatch, valid: torch.Tensor, plan: ScoringPlan
    ) -> torch.Tensor:
        """The router loss of an evaluation pass of the policy over the examples (a packed one: with their KL
        pairs, over ``batch.pairs``), over the valid rows' example tokens only (evaluation padding counts nowhere)."""
        if plan.policy_kl == "packed":
            tokens = example_tokens(self.policy, batch.pairs, valid)
        else:
            rows = plan.rows(batch, kl=False)
            mask = batch.example.attention_mask * valid[:, None]
            tokens = mask if rows is None else example_tokens(self.policy, rows, valid)
        return self._router.loss(routed, tokens)

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
        plan, batch = item.plan, item.batch
        routing = self._router.capture() if self._router is not None else contextlib.nullcontext()
        with routing as routed, recording(LogitMeans()) as item.logits:  # its KL passes record nothing
            if plan.policy_kl == "folded":
                policy_logps, item.policy_kl, _ = pair_logps(self.policy, batch)
                item.gradient_tokens -= item.counts.pairs_shared
            elif plan.policy_kl == "continued":
                head = self._lm_head(self.policy)
                policy_logps, cache = example_logps_with_cache(self.policy, batch.example, head)
                item.policy_kl = self._continued_kl(batch, cache)
                item.flops += self._flop_params(self.policy).forward(item.counts.continuation)
            else:
                vision = with_graph(item.vision, self.policy)  # the tower's graph where it trains
                policy_logps = self._view_logps(self.policy, batch, plan, False, vision)
        if routed is None:
            return policy_logps, None
        if plan.policy_kl == "folded":  # folding needs the collator's pairs (fold_pays is computed from them)
            tokens = example_tokens(self.policy, batch.pairs)
        else:
            rows = plan.rows(batch, kl=False)
            tokens = batch.example.attention_mask if rows is None else example_tokens(self.policy, rows)
        return policy_logps, self._router.loss(routed, tokens)

    def _reference_pair(
        self, batch: KTOBatch, counts: TokenCounts, plan: ScoringPlan, vision: SharedVision | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(reference log-probs [B], on the KL pairs [B] or None without KL passes, tokens of the valid rows the
        reference processed), by ``plan.reference``: precomputed from the batch (0 tokens), the examples alone,
        two passes, one shared-prompt pass (coati_kto.models.packing: the shared prompt once), or the KL pass
        continuing the examples' (the policy's path, so step-1 KL is exactly 0)."""
        path, kl = plan.reference, plan.policy_kl != "none"
        if path == "cached":
            reference_kl = batch.reference_kl_logps.float() if kl else None
            return batch.reference_logps.float(), reference_kl, 0
        if path == "examples":
            return self._view_logps(self.reference, batch, plan, False, vision), None, counts.example
        both = counts.example + counts.kl
        if path == "continued":
            head, continuation = self._lm_head(self.reference), batch.kl_continuation
            example, kl_logps = continued_logps(self.reference, batch.example, continuation, head)
            return example, kl_logps, both - counts.continuation_visible
        if path == "separate":  # two passes (or every token scored)
            views = (False, True)
            example, kl_logps = (self._view_logps(self.reference, batch, plan, v, vision) for v in views)
            return example, kl_logps, both
        example, kl_logps, _ = pair_logps(self.reference, batch)
        return example, kl_logps, both - (counts.pairs_shared if self.rules.reference_packs else 0)

    def _view_logps(
        self, model: Any, batch: KTOBatch, plan: ScoringPlan, kl: bool, vision: SharedVision | None = None
    ) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on the examples or (``kl``) the KL pairs: from the
        collator's padding-free rows where the plan runs them (coati_kto.data.packed), else the padded view (with
        the batch's shared image features, ``vision``)."""
        rows = plan.rows(batch, kl)
        if rows is None:
            keywords = vision.keywords(model, kl) if vision is not None else None
            return self.completion_logps(model, batch.kl if kl else batch.example, keywords)
        if isinstance(rows, RowSlice):  # this rank's columns; one sum over the sp group per pass
            # sp: undo the plugin's average over dp x sp (every sp rank holds the same loss; plan §2c)
            example, kl_logps = sp_packed_logps(
                model, self._lm_head(model), rows, len(batch), self.plan.sp_size
            )
            return kl_logps if kl else example
        if not can_pack(model):
            raise RuntimeError(
                "data.padding_free: this model cannot take packed rows (it needs eager, sdpa or flex attention, "
                "4D masks that reproduce its layers' windows, and a plain LM head)"
            )
        example, kl_logps = packed_logps(model, self._lm_head(model), rows, len(batch))
        return kl_logps if kl else example

    def completion_logps(self, model: Any, view: TokenView, vision: Any = None) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on one padded view (``vision``: its image keywords), as the
        passes score it (graph only under grad); every rank of a tensor-parallel group calls with the same view."""
        return view_logps(model, view, self._lm_head(model), self.options.apply_loss_mask, vision)

    def _flop_params(self, model: Any) -> FlopParams:
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
