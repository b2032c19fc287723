"""KTO's two phases through ColossalAI's pipeline schedule (``plugin.pp_size`` > 1), for training and evaluation.

Each rank holds one stage of the policy and of the reference (``coati_kto.families.shardformer.pipeline``). A step:

1. Phase 1, no gradient: one forward-only schedule run per pass (the reference on the examples and on the KL
   pairs, unless the batch carries its log-probs; the policy on the KL pairs), each over the step's micro-batches
   stacked along the rows. The last stage's criterion turns hidden states into per-row completion log-probs
   (``coati_kto.models.pipeline_stage.stage_logps``); only the last stage holds them.
2. z0 over the data-parallel group (per group of micro-batches, as ``kto.kl_scope`` says): the last stages' dp
   groups hold the KL log-ratios; every other stage enters its own dp group's collective with nothing, then the
   last stage's z0 is summed over the pipeline group so every rank logs the same value.
3. Phase 2: one training schedule run (``booster.execute_pipeline``) over the step's micro-batches with the KTO
   loss as the last stage's criterion; the reference log-probs, labels, validity and a per-row z0 ride in the
   batch (the schedule slices every tensor along its rows, so z0 is [B], not 0-dim). The plugin syncs tied
   weights and averages gradients over the data-parallel group once, after the run.

Every rank runs the same schedule runs in the same order (the p2p between stages pairs them): a rank never skips
one, whatever its rows. Rows: every micro-batch of a run has the same row count (the schedule's micro-batch
size); a short one is filled with copies of its first row that count nowhere (``valid`` False, no loss mask).
The padded view runs, never the padding-free rows (their flat targets cannot be sliced by rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional

from coati_kto.data.batch import KTOBatch, TokenView
from coati_kto.data.packed import count_tokens
from coati_kto.models.lora import base_module
from coati_kto.models.pipeline_stage import stage_logps
from coati_kto.parallel.distributed import ParallelLayout, mean_over_group
from coati_kto.trainer.loss import estimate_kl_raw, preference_loss
from coati_kto.trainer.metrics import StepSums
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.throughput import FlopParams, flop_params

_VIEW_KEYS = ("input_ids", "attention_mask", "loss_mask")
_EVAL_RUN = 16  # evaluation micro-batches per forward-only run (bounds the stacked inputs held at once)


def stacked_views(views: list[TokenView], rows: int) -> dict[str, torch.Tensor]:
    """``views`` right-padded to one length and stacked: [len(views) x rows, S] each of input_ids, attention_mask,
    loss_mask. A view of fewer rows is filled with copies of its first row whose loss mask is off (a row of padding
    alone would attend to nothing: NaN hidden states, and NaN x 0 in the weight gradients)."""
    seq = max(view.input_ids.shape[1] for view in views)
    out: dict[str, list[torch.Tensor]] = {key: [] for key in _VIEW_KEYS}
    for view in views:
        fill = rows - view.input_ids.shape[0]
        for key in _VIEW_KEYS:
            tensor = getattr(view, key)
            tensor = functional.pad(tensor, (0, seq - tensor.shape[1]))
            if fill:
                copies = tensor[:1].expand(fill, -1)
                tensor = torch.cat([tensor, torch.zeros_like(copies) if key == "loss_mask" else copies])
            out[key].append(tensor)
    return {key: torch.cat(parts) for key, parts in out.items()}


def per_row(batches: list[KTOBatch], rows: int, of: Any, fill: float | bool) -> torch.Tensor:
    """``of(batch)`` [B] of each batch, extended to ``rows`` with ``fill`` and concatenated: [len(batches) x rows],
    aligned with :func:`stacked_views`."""
    parts = []
    for batch in batches:
        values = of(batch)
        parts.append(torch.cat([values, values.new_full((rows - values.shape[0],), fill)]))
    return torch.cat(parts)


class PipelinePasses:
    """The step and the evaluation of KTO under pipeline parallelism; every rank builds one and calls both.

    ``policy`` and ``reference`` are the plugin's wrapped modules (the reference None when every batch
    carries its log-probs); ``schedule`` is the plugin's; ``kl_group`` the data-parallel group z0 reduces over.
    """

    def __init__(
        self,
        policy: Any,
        reference: Any,
        booster: Any,
        optimizer: Any,
        layout: ParallelLayout,
        options: KTOOptions,
        kl_group: Any,
        device: torch.device,
    ) -> None:
        self.policy, self.reference, self.booster, self.optimizer = policy, reference, booster, optimizer
        self.layout, self.options, self.kl_group, self.device = layout, options, kl_group, device
        self.schedule = booster.plugin.scheduler
        self.last = layout.is_last_stage
        # N for the FLOPs count: each stage holds its own parameters; their sum is the model's.
        own = flop_params(policy)
        params = torch.tensor([float(own.trainable), float(own.frozen)], dtype=torch.float64, device=device)
        dist.all_reduce(params, group=layout.pp_group)
        self.params = FlopParams(*(int(n) for n in params.tolist()))

    def tied_copies(self) -> list[torch.nn.Parameter]:
        """The tied parameters this stage holds that an earlier stage holds too (the LM head that is the
        embedding): the plugin keeps both copies' gradients equal, so the gradient norm counts the first only."""
        stage = dist.get_rank(self.layout.pp_group)
        return [
            shared[stage] for shared in self.policy.shared_params if stage in shared and stage != min(shared)
        ]

    # ---------------------------------------------------------------- training
    def train_step(self, groups: list[list[KTOBatch]], sums: StepSums) -> None:
        """One optimizer step's passes and backward over ``groups`` (each group one z0); ``sums`` gets the step's
        metrics on the last stage (the trainer counts that stage's sums only)."""
        real = [batch.to(self.device, non_blocking=True) for group in groups for batch in group]
        # 1F1B needs a micro-batch per stage: a short step (an epoch's last) is filled with rows that count nowhere.
        filler = real[-1].with_valid(torch.zeros_like(real[-1].valid_rows()))
        batches = real + [filler] * max(0, self.layout.pp_size - len(real))
        rows, count = max(len(batch) for batch in batches), len(batches)
        reference, reference_kl = self._reference(batches, rows)
        policy_kl = (
            self._scored(self.policy, [b.kl for b in batches], rows) if self.options.needs_kl else None
        )
        z0 = self._step_z0(groups, batches, rows, policy_kl, reference_kl, sums)
        scale = mean_over_group(float(sum(len(b) for b in real)), self.kl_group, self.device)
        constants = self._constants(batches, rows, reference, z0) if self.last else {}
        batch = stacked_views([b.example for b in batches], rows) | constants
        records: list[tuple[torch.Tensor, ...]] = []
        criterion = self._kto_criterion(records, scale, count)
        self._set_schedule(count, rows)
        self.booster.execute_pipeline(
            iter([batch]), self.policy, criterion, self.optimizer, return_loss=False, return_outputs=False
        )
        if self.last:
            self._record(real, records[: len(real)], sums, train=True)

    def _constants(
        self, batches: list[KTOBatch], rows: int, reference: torch.Tensor, z0: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """The last stage's per-row constants of the loss, [count x rows] each: label, validity, the reference
        log-probs (fp32: the criterion reads the schedule's uncast batch) and z0."""
        out = {
            "label": per_row(batches, rows, lambda b: b.label.bool(), False),
            "valid": per_row(batches, rows, KTOBatch.valid_rows, False),
            "reference_logps": reference,
        }
        if z0 is not None:
            out["z0"] = z0
        return out

    def _kto_criterion(self, records: list, scale: torch.Tensor, count: int) -> Any:
        """The last stage's loss of one micro-batch: its KTO losses summed over valid rows / the step's rows per
        dp rank (``scale``), times ``count`` (the schedule divides each micro-batch's loss by the count)."""
        module = base_module(self.policy)

        def criterion(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]) -> torch.Tensor:
            logps, means = stage_logps(
                module, outputs["hidden_states"], micro["input_ids"], micro["loss_mask"], True
            )
            losses, rewards = self._loss(logps, micro["reference_logps"], micro["label"], micro.get("z0"))
            records.append((losses.detach(), rewards.detach(), logps.detach(), means))
            return torch.where(micro["valid"], losses, 0.0).sum() / scale * count

        return criterion

    def _loss(self, logps: Any, reference: Any, labels: Any, z0: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row (losses, rewards) of the run's loss type; ``z0`` per row [N], 0-dim, or None."""
        options = self.options
        return preference_loss(
            options.loss_type,
            logps,
            reference,
            labels,
            z0,
            options.beta,
            options.desirable_weight,
            options.undesirable_weight,
        )

    # ---------------------------------------------------------------- phase 1
    def _scored(self, model: Any, views: list[TokenView], rows: int, record: list | None = None) -> Any:
        """Per-row completion log-probs [len(views) x rows] fp32 of ``model`` on ``views``: one forward-only run;
        the last stage's result (None on the others). ``record``: the run's logit means, one per view."""
        module = base_module(model)
        scores: list[torch.Tensor] = []

        def criterion(outputs: dict[str, torch.Tensor], micro: dict[str, torch.Tensor]) -> torch.Tensor:
            logps, means = stage_logps(
                module, outputs["hidden_states"], micro["input_ids"], micro["loss_mask"], record is not None
            )
            scores.append(logps)
            if record is not None:
                record.append(means)
            return logps.sum() * 0.0

        self._set_schedule(len(views), rows)
        with torch.no_grad():
            self.schedule.forward_backward_step(model, iter([stacked_views(views, rows)]), criterion, None)
        return torch.cat(scores) if self.last else None

    def _reference(self, batches: list[KTOBatch], rows: int) -> tuple[Any, Any]:
        """The reference's (example, KL) log-probs [count x rows] on the last stage: the batches' precomputed
        ones where every batch carries them (no reference run), else two forward-only runs."""
        kl = self.options.needs_kl
        if all(b.reference_logps is not None for b in batches):
            example = per_row(batches, rows, lambda b: b.reference_logps.float(), 0.0)
            if not kl:
                return example, None
            if all(b.reference_kl_logps is not None for b in batches):
                return example, per_row(batches, rows, lambda b: b.reference_kl_logps.float(), 0.0)
        if self.reference is None:
            raise ValueError("no reference model and the batch has no precomputed reference_logps")
        example = self._scored(self.reference, [b.example for b in batches], rows)
        return example, self._scored(self.reference, [b.kl for b in batches], rows) if kl else None

    def _step_z0(
        self,
        groups: list[list[KTOBatch]],
        batches: list[KTOBatch],
        rows: int,
        policy_kl: Any,
        reference_kl: Any,
        sums: StepSums,
    ) -> torch.Tensor | None:
        """z0 per row [count x rows] (one value per group; 0 on filling micro-batches after the groups'), on every
        stage; recorded in ``sums``."""
        if not self.options.needs_kl:
            return None
        valid = per_row(batches, rows, KTOBatch.valid_rows, False)
        values, start = [], 0
        for group in groups:
            span = slice(start * rows, (start + len(group)) * rows)
            z0 = self._z0(policy_kl, reference_kl, valid, span, sums)
            values.append(z0.expand(len(group) * rows))
            start += len(group)
        return functional.pad(torch.cat(values), (0, (len(batches) - start) * rows))

    def _z0(self, policy_kl: Any, reference_kl: Any, valid: Any, span: slice, sums: StepSums) -> Any:
        """z0 (0-dim) of the rows in ``span``: reduced over the data-parallel group from the last stage's KL
        log-ratios (None: no rows here), then summed over the pipeline group (the others add 0) so every stage
        logs it."""
        if self.last and policy_kl is not None:
            raw = estimate_kl_raw(policy_kl[span], reference_kl[span], group=self.kl_group, valid=valid[span])
        else:  # this stage's dp group holds no KL log-ratio: its collective, entered with nothing
            empty = torch.zeros(0, device=self.device)
            raw = estimate_kl_raw(empty, empty, group=self.kl_group) * 0.0
        raw = raw.reshape(1).double()
        dist.all_reduce(raw, group=self.layout.pp_group)
        raw = raw.reshape(()).float()
        z0 = raw.clamp(min=0.0)
        sums.add_kl(z0, raw)
        return z0

    # ---------------------------------------------------------------- evaluation
    def evaluate(self, batches: Iterable[KTOBatch]) -> StepSums:
        """The eval set's sums without gradient, one z0 over all of it (on the last stage; z0 on every stage). The
        set stays where the loader put it: each run of ``_EVAL_RUN`` micro-batches goes to the device in turn, so
        the device holds one run's batches and every run's per-row results, never the whole set's tensors."""
        sums = StepSums(self.device, evaluation=True)
        batches = list(batches)
        if not batches:  # still enter z0's collectives: the other ranks do
            if self.options.needs_kl:
                self._z0(None, None, None, slice(0), sums)
            return sums
        rows = max(len(batch) for batch in batches)
        runs = [batches[i : i + _EVAL_RUN] for i in range(0, len(batches), _EVAL_RUN)]
        scored = [self._eval_run(run, rows) for run in runs]
        z0 = None
        if self.options.needs_kl:
            valid = torch.cat([s[6] for s in scored])
            policy_kl = torch.cat([s[2] for s in scored]) if self.last else None
            reference_kl = torch.cat([s[3] for s in scored]) if self.last else None
            z0 = self._z0(policy_kl, reference_kl, valid, slice(None), sums)
        if self.last:
            records, masks = [], []
            for run, (policy, means, _, _, reference, labels, valid) in zip(runs, scored, strict=True):
                losses, rewards = self._loss(policy, reference, labels, z0)
                for i in range(len(run)):
                    span = slice(i * rows, (i + 1) * rows)
                    records.append((losses[span], rewards[span], policy[span], means[i]))
                    masks.append((labels[span], valid[span]))
            self._record(batches, records, sums, train=False, masks=masks)
        return sums

    def _eval_run(self, run: list[KTOBatch], rows: int) -> tuple[Any, ...]:
        """(policy examples, their logit means, policy KL, reference KL, reference examples, labels, validity) of
        one run, per row [len(run) x rows] on the device; the run's batches are on the device only in here."""
        run = [batch.to(self.device, non_blocking=True) for batch in run]
        means: list = []
        policy = self._scored(self.policy, [b.example for b in run], rows, means)
        kl = self.options.needs_kl
        policy_kl = self._scored(self.policy, [b.kl for b in run], rows) if kl else None
        reference, reference_kl = self._reference(run, rows)
        labels = per_row(run, rows, lambda b: b.label.bool(), False)
        valid = per_row(run, rows, KTOBatch.valid_rows, False)
        return policy, means, policy_kl, reference_kl, reference, labels, valid

    # ---------------------------------------------------------------- shared
    def _record(
        self, batches: list[KTOBatch], records: list, sums: StepSums, train: bool, masks: list | None = None
    ) -> None:
        """The last stage's sums of each micro-batch (the filling rows count nowhere): the metrics, its tokens and
        the model FLOPs of its passes (every stage's, counted here once). ``masks``: each batch's (labels, validity)
        on the device, where ``batches`` are still on the host (evaluation); else the batches' own."""
        kl = self.options.needs_kl
        for i, (batch, (losses, rewards, logps, means)) in enumerate(zip(batches, records, strict=True)):
            size = len(batch)
            counts = batch.counts or count_tokens(batch)
            labels, valid = masks[i] if masks is not None else (batch.label, batch.valid_rows())
            if means is not None and means.sums is not None:
                means.sums, means.tokens = means.sums[:size], means.tokens[:size]
            sums.add(losses[:size], rewards[:size], logps[:size], labels[:size].bool(), valid[:size], means)
            kl_tokens = counts.kl if kl else 0
            reference_runs = batch.reference_logps is None
            forward = kl_tokens + (counts.example + kl_tokens if reference_runs else 0)
            flops = self.params.forward(forward + (0 if train else counts.example))
            flops += self.params.train(counts.example) if train else 0.0
            sums.add_host(tokens=counts.example + kl_tokens, flops=flops)

    def _set_schedule(self, count: int, rows: int) -> None:
        """The schedule's run shape: ``count`` micro-batches of ``rows`` rows. ColossalAI keeps the first run's
        micro-batch size and batch size across runs (and asserts a training run's batch equals the last one's),
        while evaluation and the passes here change both."""
        schedule = self.schedule
        schedule.microbatch_size = rows
        schedule.last_batch_size = None
        if hasattr(schedule, "num_microbatch"):  # interleaved
            schedule.num_microbatch = count
        else:
            schedule.num_microbatches = count
