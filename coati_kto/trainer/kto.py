"""KTOTrainer: KTO (Ethayarajh et al. 2024) on a ColossalAI Booster, read top to bottom.

One optimizer step (``_train_step``) on every rank:

1. no-grad passes over each micro-batch of the step: the policy on the KL pairs, the reference model on the
   examples and their KL pairs (two passes, or one shared-prompt pass: coati_kto.models.packing), or precomputed
   ``reference_logps`` / ``reference_kl_logps`` from the batch (kto.reference cached: no reference model).
   With ``pack_policy``, a micro-batch that is its own z0 group and has long prompts folds the policy's KL
   pass into step 3's gradient pass instead (one packed row; z0 is reduced between its forward and backward);
2. the reference point z0 from the KL log-ratios of every micro-batch of the step on every data-parallel rank
   (``kto.kl_scope: step``; ``micro_batch`` estimates one z0 per micro-batch instead). With
   ``loss_type="apo_zero_unpaired"`` there is no z0: the KL-pair passes of step 1 and this collective are
   skipped on every rank alike;
3. the policy pass with gradient per micro-batch, the KTO loss, ``booster.backward`` of
   sum(per-example loss) / (rows x micro-batches in the step): the plugins average gradients over the
   data-parallel ranks (DDP, ZeRO's reduce-scatter and the hybrid plugin all divide by the dp size), so the
   gradient is that of the mean per-example loss over the global batch, whatever the layout;
4. one all-reduce of the step's metric sums, which also carries this rank's share of the squared global
   gradient norm (coati_kto.parallel.grad_norm) and so the non-finite vote on loss AND gradient: every rank
   decides to step, skip or stop identically, before any weight changes; then the optimizer steps, clipping
   with that norm (no second norm computation), and the LR scheduler steps.

Evaluation runs the same passes without gradient, with one z0 over the whole eval set: at fit start
(``eval_at_start``, the baseline, unless that step was already evaluated), every ``eval_interval`` steps and
at each epoch end (``eval_at_epoch_end``).

Every collective has the same shape and dtype on every rank whatever its labels: the loss picks its branch
with a label mask (coati_kto.trainer.loss), z0 reduces a fixed [sum, count] pair, metrics a fixed set of sums.

Dropout: KTO's log-ratios compare the policy with the reference, so both must be deterministic. The policy
stays in train mode (gradient checkpointing needs it) with every dropout probability set to 0 here; the
reference model is in eval mode. The model configs are left untouched, so the exported model keeps them.

Gradient accumulation uses the plugin's no-sync context where it has one (DDP, hybrid zero 0/1, low-level
ZeRO-1): only the last micro-batch of a step reduces gradients. ZeRO-2 (hybrid or low-level) asserts against
no_sync, so there every backward reduce-scatters and gradients accumulate in the ZeRO buffers.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from coati_kto.data.batch import KTOBatch, TokenView
from coati_kto.errors import UserError
from coati_kto.models.logprobs import LMHead, model_sequence_logps
from coati_kto.models.packing import can_pack, fold_pays, pair_logps
from coati_kto.parallel.distributed import ParallelLayout, reduce_sums
from coati_kto.parallel.grad_norm import global_norm
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.runtime.signals import StopSignals, TrainingStoppedError, decide
from coati_kto.trainer.base import SLTrainer
from coati_kto.trainer.logging import MetricWriter, ProgressBar
from coati_kto.trainer.loss import estimate_kl_raw, needs_kl, preference_loss
from coati_kto.trainer.metrics import IntervalMeter, StepSums, summarize
from coati_kto.trainer.run_summary import config_markdown, data_stats_markdown, flat_hparams
from coati_kto.trainer.throughput import flop_params, forward_flops, mfu, train_flops

_DROPOUT_ATTRS = ("attention_dropout", "attn_dropout", "hidden_dropout", "dropout", "dropout_rate")
HISTORY_LENGTH = 10_000  # logged records kept in memory (TensorBoard/W&B hold the full run)
_GRAD_SQ = "grad_sq"  # this rank's share of the squared gradient norm, in the step's metric all-reduce


class NonFiniteLossError(UserError):
    """A NaN/inf loss or gradient norm with ``train.on_nonfinite: stop``; raised on every rank at the same step,
    before any update."""


@dataclass
class _NoGradPass:
    """One micro-batch's no-grad log-probs, [B] fp32 each, and its labels/validity.

    ``batch`` is kept only while its policy pass with gradient is pending (training), then dropped.
    """

    batch: KTOBatch | None
    labels: torch.Tensor  # [B] bool
    valid: torch.Tensor  # [B] bool; False on evaluation padding rows
    tokens: torch.Tensor  # 0-dim: non-padding tokens of valid examples (and of their KL pairs, when run)
    gradient_tokens: torch.Tensor  # 0-dim: tokens the gradient pass processes (valid rows; packed if folded)
    flops: torch.Tensor  # 0-dim float64: model FLOPs of the no-grad passes run here
    reference: torch.Tensor
    policy_kl: torch.Tensor | None  # None when the loss has no reference point (no KL passes run)
    reference_kl: torch.Tensor | None
    policy: torch.Tensor | None  # evaluation only: the policy's log-probs, computed without gradient
    folded: bool = False  # the policy's KL pass runs inside its gradient pass (one packed pass)


class KTOTrainer(SLTrainer):
    """KTO on a boosted policy, a frozen reference model and a dataloader of the batch contract.

    The constructor up to ``coordinator`` is ColossalChat's KTOTrainer's (``actor`` is the policy,
    ``ref_model`` the reference); ``coordinator`` is accepted for that signature and unused (ranks come from
    ``layout``). Every rank constructs it and calls ``fit``.

    Batches are :class:`~coati_kto.data.batch.KTOBatch` (tensors on any device): the examples and their KL
    pairs as two token views, labels, and optionally precomputed reference log-probs (the reference model may
    then be None) and ``valid`` (evaluation padding rows are False and count nowhere).

    Extra keyword arguments:
        layout: the ParallelLayout (default: from ``plugin``).
        loss_type: "kto" or "apo_zero_unpaired" (no reference point: no KL-pair passes, no z0 collective).
        kl_scope: "step" (z0 over the whole optimizer step, all ranks) or "micro_batch".
        max_steps: stop after this many optimizer steps (None: ``max_epochs`` epochs).
        eval_interval: evaluate every N optimizer steps (0: none between epoch ends).
        eval_at_start: evaluate before the first update of ``fit`` (the step-0 baseline; on resume, only when
            the checkpoint's step was not evaluated yet).
        eval_at_epoch_end: evaluate after each epoch's last step (the run's last step included), unless that
            step was just evaluated.
        log_interval: write train metrics every N steps, exact over the interval.
        on_nonfinite: "stop" (raise NonFiniteLossError) or "skip" (zero the gradients, no update, counted), when
            the loss or the global gradient norm is NaN/inf on any rank.
        max_grad_norm: clip the global gradient norm to this (0: off) where the plugin does not clip (ddp);
            ZeRO and hybrid optimizers clip with the plugin's own max_norm (build_plugin gives them the same).
        checkpoint_manager: a coati_kto.trainer.checkpoint.CheckpointManager (default: one under ``save_dir``).
        run_config: the resolved config as a dict; stored in every checkpoint, sent to W&B and written to
            TensorBoard (text and hparams).
        data_stats: the prepared data's stats.json (coati_kto.data.prepared); written to TensorBoard as text.
        wandb_project, wandb_mode, wandb_dir: W&B settings when ``fit(use_wandb=True)``.
        stop_signals: the installed StopSignals (train.py); a stop request checkpoints and raises
            TrainingStoppedError on every rank after the step it was voted in.
        plan: the run's coati_kto.parallel.plan.ParallelPlan (default: recovered from ``plugin``); it says whether
            accumulation may skip gradient sync and which group z0 reduces over.
        peak_flops: peak FLOP/s per device; when set, ``train/mfu`` is logged (coati_kto.trainer.throughput).
        pack_reference: score an example and its KL pair in one shared-prompt reference pass (coati_kto.models.packing)
            where the model allows it. Off by default: equal to two passes only within rounding (fp32 ~1e-7,
            bf16 ~1e-3 nats), so step-0 rewards would no longer be exactly 0 (the policy's passes are separate).
        pack_policy: the policy's passes in one packed row too: in evaluation always; in training where a
            z0 group is one micro-batch and :func:`~coati_kto.models.packing.fold_pays` (long prompts, short
            completions), folding its KL pass into the gradient pass. Same rounding caveat.
    """

    def __init__(
        self,
        actor: Any,
        ref_model: Any,
        booster: Any,
        actor_optim: torch.optim.Optimizer,
        plugin: Any,
        actor_lr_scheduler: Any,
        tokenizer: Any,
        max_epochs: int = 1,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        apply_loss_mask: bool = True,
        accumulation_steps: int = 1,
        start_epoch: int = 0,
        save_interval: int = 0,
        save_dir: str | None = None,
        coordinator: Any = None,
        *,
        layout: ParallelLayout | None = None,
        loss_type: str = "kto",
        kl_scope: Literal["step", "micro_batch"] = "step",
        max_steps: int | None = None,
        eval_interval: int = 0,
        eval_at_start: bool = False,
        eval_at_epoch_end: bool = True,
        log_interval: int = 1,
        on_nonfinite: Literal["stop", "skip"] = "stop",
        max_grad_norm: float = 0.0,
        checkpoint_manager: Any = None,
        keep_last: int = 2,
        run_config: dict | None = None,
        data_stats: dict | None = None,
        wandb_project: str = "coati-kto",
        wandb_mode: str = "online",
        wandb_dir: str | None = None,
        stop_signals: StopSignals | None = None,
        plan: ParallelPlan | None = None,
        peak_flops: float | None = None,
        pack_reference: bool = False,
        pack_policy: bool = False,
    ) -> None:
        super().__init__(booster, max_epochs, actor, actor_optim, plugin, start_epoch)
        if accumulation_steps < 1 or log_interval < 1 or save_interval < 0 or eval_interval < 0:
            raise ValueError("accumulation_steps and log_interval must be >= 1, save/eval intervals >= 0")
        if kl_scope not in ("step", "micro_batch") or on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"kl_scope={kl_scope!r} / on_nonfinite={on_nonfinite!r} not understood")
        self.policy = actor
        self.reference = ref_model
        self.lr_scheduler = actor_lr_scheduler
        self.tokenizer = tokenizer
        self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight
        self.apply_loss_mask = apply_loss_mask
        self.pack_reference = pack_reference
        self.pack_policy = pack_policy
        self._policy_packing: bool | None = None
        self.accumulation_steps = accumulation_steps
        self.save_interval, self.eval_interval, self.log_interval = save_interval, eval_interval, log_interval
        self.kl_scope, self.max_steps, self.on_nonfinite = kl_scope, max_steps, on_nonfinite
        self.loss_type = loss_type
        self._needs_kl = needs_kl(loss_type)  # ValueError on an unknown loss type
        self.eval_at_start, self.eval_at_epoch_end = eval_at_start, eval_at_epoch_end
        self.layout = layout or ParallelLayout.from_plugin(plugin)
        # Everything plugin-specific is asked of the plan (built from the plugin when not given).
        self.plan = plan or ParallelPlan.from_plugin(plugin)
        if checkpoint_manager is None and save_dir is not None:
            from coati_kto.trainer.checkpoint import CheckpointManager

            checkpoint_manager = CheckpointManager(Path(save_dir), booster, self.layout, keep_last)
        self.checkpoint_manager = checkpoint_manager
        self.run_config = run_config
        self.data_stats = data_stats
        self.stop_signals = stop_signals or StopSignals()  # not installed: never votes to stop
        self._stop_signal: str | None = None
        self.wandb_settings = {
            "project": wandb_project,
            "mode": wandb_mode,
            "dir": wandb_dir or save_dir or ".",
        }

        from colossalai.accelerator import get_accelerator

        self.device = get_accelerator().get_current_device()
        self._kl_group = self.plan.kl_group(self.layout)
        self._use_no_sync = plugin is not None and self.plan.no_sync_accumulation
        self._grad_norm = self.plan.gradient_norm(actor_optim, self.layout, max_grad_norm)

        self.skipped_steps = 0
        # The last logged records, {"step": ..., "train/loss": ..., ...}, on all ranks (callers, tests).
        self.history: deque[dict[str, float]] = deque(maxlen=HISTORY_LENGTH)
        self._epoch: int | None = None  # epoch of the running (or last) step
        self._consumed = 0  # micro-batches of self._epoch consumed on this rank
        self._last_lr = float("nan")
        self._resume: dict[str, Any] | None = None
        self._last_saved_step: int | None = None
        self._heads: dict[int, LMHead | None] = {}  # per model: its chunked LM head, or None
        self._params: dict[int, int] = {}  # per model: N for the model FLOPs count
        self.peak_flops = peak_flops
        self._last_eval_step: int | None = None
        self._interval = IntervalMeter()
        self._writer: MetricWriter | None = None
        self._progress: ProgressBar | None = None
        _disable_dropout(self.policy)  # LoRA's dropout layers too
        # A LoRA run's reference is the policy with its adapters off (coati_kto.models.lora): not frozen here.
        if isinstance(self.reference, nn.Module):
            _disable_dropout(self.reference)
            self.reference.eval()
            self.reference.requires_grad_(False)

    # ---------------------------------------------------------------- resume / setup
    def resume(self, checkpoint: str | Path) -> None:
        """Restore model, optimizer, scheduler, RNG and the step/epoch/data position; every rank calls, before fit."""
        if self.checkpoint_manager is None:
            raise ValueError("resume needs a checkpoint_manager (or save_dir)")
        state = self.checkpoint_manager.load(Path(checkpoint), self.policy, self.optimizer, self.lr_scheduler)
        self.global_step = int(state["global_step"])
        self.start_epoch = int(state["epoch"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._resume = state
        self._last_saved_step = self.global_step
        # An evaluation at the checkpoint's step already happened (and was logged): do not repeat it.
        self._last_eval_step = state.get("last_eval_step")

    def _before_fit(
        self, train_dataloader: Any, eval_dataloader: Any, log_dir: str | None, use_wandb: bool
    ) -> None:
        self._train_loader, self._eval_loader = train_dataloader, eval_dataloader
        self.steps_per_epoch = math.ceil(len(train_dataloader) / self.accumulation_steps)
        total = self.steps_per_epoch * self.max_epochs
        total = min(total, self.max_steps) if self.max_steps else total
        resumed = self._resume is not None
        wandb = {**self.wandb_settings, "config": self.run_config} if use_wandb else None
        self._writer = MetricWriter(
            self.layout.is_main,
            log_dir,
            purge_step=self.global_step + 1 if resumed else None,
            wandb_settings=wandb,
        )
        self._progress = ProgressBar(self.layout.is_main, total, initial=self.global_step)
        self._write_run_summary()
        self.policy.train()
        if self.eval_at_start and self._eval_loader is not None and self._last_eval_step != self.global_step:
            self._evaluate()  # the baseline: every eval/ curve starts from the model the run began with

    def _write_run_summary(self) -> None:
        """The resolved config and the data statistics as TensorBoard text (and hparams), at the start step."""
        if self._writer is None:
            return
        if self.run_config is not None:
            self._writer.text("run/config", config_markdown(self.run_config), self.global_step)
            self._writer.hparams(flat_hparams(self.run_config), ("eval/loss", "eval/rewards/margin"))
        if self.data_stats is not None:
            self._writer.text("run/data", data_stats_markdown(self.data_stats), self.global_step)
        self._writer.flush()

    def _finished(self) -> bool:
        return self.max_steps is not None and self.global_step >= self.max_steps

    # ---------------------------------------------------------------- training
    def _train(self, epoch: int) -> None:
        self._epoch = epoch
        for micro_batches in self._epoch_steps(epoch):
            self._train_step(micro_batches, epoch)
            if self.eval_interval and self.global_step % self.eval_interval == 0:
                self._evaluate()
            if self.save_interval and self.global_step % self.save_interval == 0:
                self._save(epoch)
            if self._stop_signal is not None:
                self._stop(epoch)
            if self._finished():
                break

    def _epoch_steps(self, epoch: int) -> Iterator[list[KTOBatch]]:
        """This rank's micro-batches of ``epoch`` in groups of ``accumulation_steps`` (the last may be shorter).

        On resume inside the epoch the sampler is positioned after the consumed micro-batches (the remaining
        ones follow, as if never interrupted); a loader without such a sampler has the consumed prefix skipped.
        """
        loader = self._train_loader
        sampler = getattr(loader, "batch_sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        resume, self._resume = self._resume, None  # applies to the first epoch run after resume() only
        start = int(resume["consumed"]) if resume is not None and int(resume["epoch"]) == epoch else 0
        old_ranks = (
            resume.get("rank_states") if resume is not None and int(resume["epoch"]) == epoch else None
        )
        if old_ranks is not None:  # another layout: the rest of the epoch is re-planned over this one's ranks
            batches = self._replanned_batches(sampler, old_ranks, epoch)
            start = sampler.start
        elif start and hasattr(sampler, "load_state_dict"):
            saved = resume.get("sampler") or {}
            try:
                sampler.load_state_dict({**saved, "epoch": epoch, "position": start})
            except ValueError as err:
                raise UserError(
                    f"train.resume: the checkpoint's data order does not fit this run: {err}"
                ) from None
            batches: Iterator = iter(loader)
        else:
            batches = itertools.islice(iter(loader), start, None)
        self._consumed = start
        while chunk := list(itertools.islice(batches, self.accumulation_steps)):
            yield chunk

    def _replanned_batches(self, sampler: Any, old_ranks: list[dict[str, Any]], epoch: int) -> Iterator:
        """Position ``sampler`` from every old data-parallel rank's saved state (a resume on another layout)."""
        if not hasattr(sampler, "load_state_dicts") or any(s.get("sampler") is None for s in old_ranks):
            raise UserError(
                "train.resume: the checkpoint was saved on another parallel layout and this data loader cannot "
                "re-plan the interrupted epoch (it needs coati_kto's MixedLabelBatchSampler in both runs)"
            )
        states = [{**s["sampler"], "epoch": epoch, "position": int(s["consumed"])} for s in old_ranks]
        try:
            sampler.load_state_dicts(states)
        except ValueError as err:
            raise UserError(
                f"train.resume: the checkpoint's data order does not fit this run: {err}"
            ) from None
        return iter(self._train_loader)

    def _train_step(self, micro_batches: list[KTOBatch], epoch: int) -> None:
        started = time.perf_counter()
        step = self.global_step + 1
        groups = [micro_batches] if self.kl_scope == "step" else [[b] for b in micro_batches]
        sums = self._forward(groups, train=True, num_micro_batches=len(micro_batches))
        local, kl = sums.local()
        local[_GRAD_SQ] = float(self._grad_norm.local_share())
        # The step's one metric collective: its "nonfinite" count, the gradient norm and the stop keys are the
        # votes every rank acts on.
        vote = self.stop_signals.vote()
        totals = reduce_sums({**local, **vote}, self.layout.dp_group)
        if self.layout.dp_size < self.layout.world_size:  # tensor-parallel peers vote in other dp groups
            totals.update(reduce_sums(vote, None))
        self._stop_signal = decide(totals)
        norm = global_norm(totals.pop(_GRAD_SQ))
        bad_grad = not math.isfinite(norm) and not self._grad_norm.loss_scaled
        grad_norm = None
        skipped = totals["nonfinite"] > 0 or bad_grad
        if skipped:
            self.optimizer.zero_grad()
            if self.on_nonfinite == "stop":
                raise NonFiniteLossError(self._nonfinite_message(step, epoch, bad_grad))
            self.skipped_steps += 1
        else:
            self._grad_norm.step(norm)  # fp16: the loss scaler may still skip an overflowing step here
            self.optimizer.zero_grad()
            grad_norm = self._grad_norm.unscaled(norm) if math.isfinite(norm) else None
        lr = self._current_lr()
        if self.lr_scheduler is not None:
            # Advanced on skipped steps too: the LR stays a function of the global step (exact resume).
            self.lr_scheduler.step()
        self.global_step = step
        self._consumed += len(micro_batches)

        seconds = time.perf_counter() - started
        if skipped:
            # A skipped step's sums may be NaN: they stay out of the interval, which counts the step only.
            self._interval.skip(seconds)
            step_metrics: dict[str, float] = {}
        else:
            self._interval.add(totals, kl, seconds, grad_norm)
            step_metrics = {f"train/{k}": v for k, v in summarize(totals, kl).items()}
        if self._progress is not None:
            self._progress.update(step_metrics)
        self._last_lr = lr
        if step % self.log_interval == 0:
            self._log_interval()

    def _log_interval(self) -> None:
        metrics = {f"train/{k}": v for k, v in self._interval.summary().items()}
        metrics.update({"train/lr": self._last_lr, "train/skipped_steps": float(self.skipped_steps)})
        devices = self.layout.world_size
        utilisation = mfu(metrics.get("train/model_flops_per_second", 0.0), self.peak_flops, devices)
        if utilisation is not None:
            metrics["train/mfu"] = utilisation
        self._record(metrics)
        self._interval.reset()

    def _forward(
        self, groups: Iterable[Iterable[KTOBatch]], train: bool, num_micro_batches: int = 1
    ) -> StepSums:
        """Run every micro-batch of ``groups``; one reference point z0 per group. Backward when ``train``.

        Phase 1 (no grad) runs over a whole group before z0 exists; phase 2 needs z0. In evaluation the policy
        log-probs come from phase 1 and batches are dropped at once, so a whole eval set can be one group.
        A group of one training micro-batch may fold the policy's KL pass into its gradient pass (one packed
        pass, ``pack_policy``): z0 is then reduced between that forward and its backward, still once per group
        on every rank, folded or not.
        """
        sums = StepSums(self.device)
        done = 0
        for group in groups:
            group = list(group)
            passes = [self._no_grad_pass(batch, train, may_fold=len(group) == 1) for batch in group]
            folded = bool(passes) and passes[0].folded  # only a group of one micro-batch folds
            z0 = self._z0(passes, sums) if self._needs_kl and not folded else None
            for item in passes:
                done += 1
                last = done == num_micro_batches
                with self._grad_sync(last) if train else contextlib.nullcontext():
                    if item.folded:
                        policy_logps, item.policy_kl, shared = pair_logps(self.policy, item.batch)
                        item.gradient_tokens = item.gradient_tokens - torch.where(item.valid, shared, 0).sum()
                        z0 = self._z0([item], sums)
                    else:
                        policy_logps = self._policy_logps(item.batch) if train else item.policy
                    losses, rewards = preference_loss(
                        self.loss_type,
                        policy_logps,
                        item.reference,
                        item.labels,
                        z0,
                        self.beta,
                        self.desirable_weight,
                        self.undesirable_weight,
                    )
                    if train:
                        scale = item.labels.numel() * num_micro_batches
                        loss = torch.where(item.valid, losses, 0.0).sum() / scale
                        self.booster.backward(loss, self.optimizer)
                item.batch = None
                grad_flops = (
                    train_flops(self._flop_params(self.policy), item.gradient_tokens) if train else 0.0
                )
                sums.add_flops(item.flops + grad_flops)
                sums.add(losses, rewards, policy_logps, item.labels, item.valid, item.tokens)
        return sums

    def _z0(self, passes: list[_NoGradPass], sums: StepSums) -> torch.Tensor:
        """z0 of a group (one collective); recorded with its unclamped value."""
        raw = self._reference_point(passes)
        z0 = raw.clamp(min=0.0)  # the paper's clamp, after averaging; raw is logged beside it
        sums.add_kl(z0, raw)
        return z0

    def _no_grad_pass(self, batch: KTOBatch, train: bool, may_fold: bool = False) -> _NoGradPass:
        """The reference's log-probs and the policy's without gradient: on the KL pairs (unless the KL pass
        folds into the gradient pass) and, in evaluation, on the examples (one packed pass with
        ``pack_policy``)."""
        batch = batch.to(self.device, non_blocking=True)
        labels = batch.label.bool()
        valid = batch.valid_rows()
        example_tokens = torch.where(valid, batch.example.lengths(), 0).sum()
        kl_tokens = torch.where(valid, batch.kl.lengths(), 0).sum()
        if not self._needs_kl:  # apo_zero_unpaired: no pass runs on the KL pairs
            kl_tokens = torch.zeros_like(kl_tokens)
        packs = self._needs_kl and self._policy_packs()
        folded = train and may_fold and packs and fold_pays(batch)
        policy = policy_kl = None
        with torch.no_grad():
            reference, reference_kl, shared = self._reference_pair(batch, kl=self._needs_kl)
            # Model FLOPs of the passes that run: the reference unless the batch carries its log-probs, and
            # the policy's no-grad passes (a packed pass counts the shared prompt once).
            flops = torch.zeros((), dtype=torch.float64, device=self.device)
            if shared is not None:
                flops = flops + self._packed_flops(self.reference, batch, shared, valid)
            if not train and packs:
                policy, policy_kl, policy_shared = pair_logps(self.policy, batch)
                flops = flops + self._packed_flops(self.policy, batch, policy_shared, valid)
            else:
                if not train:
                    policy = self._sequence_logps(self.policy, batch.example)
                if self._needs_kl and not folded:
                    policy_kl = self._sequence_logps(self.policy, batch.kl)
                none = torch.zeros_like(example_tokens)
                run = (none if train else example_tokens) + (none if folded else kl_tokens)
                flops = flops + forward_flops(self._flop_params(self.policy), run)
        return _NoGradPass(
            batch=batch if train else None,
            labels=labels,
            valid=valid,
            tokens=example_tokens + kl_tokens,
            gradient_tokens=example_tokens + kl_tokens if folded else example_tokens,
            flops=flops,
            reference=reference,
            policy_kl=policy_kl,
            reference_kl=reference_kl,
            policy=policy,
            folded=folded,
        )

    def _policy_packs(self) -> bool:
        """Whether the policy's passes pack example and KL pair (``pack_policy``, the loss mask on, and a model
        :func:`~coati_kto.models.packing.can_pack` takes); decided once."""
        if self._policy_packing is None:
            self._policy_packing = self.pack_policy and self.apply_loss_mask and can_pack(self.policy)
        return self._policy_packing

    def _packed_flops(
        self, model: Any, batch: KTOBatch, shared: torch.Tensor, valid: torch.Tensor
    ) -> torch.Tensor:
        """Forward FLOPs of one pass over examples and KL pairs that processed ``shared`` prompt tokens once."""
        run = batch.example.lengths() - shared + (batch.kl.lengths() if self._needs_kl else 0)
        return forward_flops(self._flop_params(model), torch.where(valid, run, 0).sum())

    def _reference_point(self, passes: list[_NoGradPass]) -> torch.Tensor:
        """The unclamped KL estimate over the valid KL pairs of ``passes`` on every data-parallel rank (one
        collective); z0 is its max with 0."""
        if not passes:  # still enter the collective: the other ranks do
            empty = torch.zeros(0, device=self.device)
            return estimate_kl_raw(empty, empty, group=self._kl_group)
        policy_kl = torch.cat([p.policy_kl[p.valid] for p in passes])
        reference_kl = torch.cat([p.reference_kl[p.valid] for p in passes])
        return estimate_kl_raw(policy_kl, reference_kl, group=self._kl_group)

    def _policy_logps(self, batch: KTOBatch) -> torch.Tensor:
        """The policy's completion log-probs [B] fp32 with gradient (the only pass that builds a graph)."""
        return self._sequence_logps(self.policy, batch.example)

    def _reference_pair(
        self, batch: KTOBatch, kl: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(reference log-probs [B], on the KL pairs [B] or None when ``kl`` is False, prompt tokens [B] shared
        by one packed pass or None when nothing ran): precomputed from the batch, else one shared-prompt pass
        (coati_kto.models.packing), or the examples alone without ``kl``."""
        if batch.reference_logps is not None and (not kl or batch.reference_kl_logps is not None):
            reference_kl = batch.reference_kl_logps.float() if kl else None
            return batch.reference_logps.float(), reference_kl, None
        if self.reference is None:
            raise ValueError("no reference model and the batch has no precomputed reference_logps")
        zeros = torch.zeros_like(batch.label, dtype=torch.long)
        if not kl:
            return self._sequence_logps(self.reference, batch.example), None, zeros
        if not self.apply_loss_mask or not self.pack_reference:  # two passes (or every token scored)
            return (
                self._sequence_logps(self.reference, batch.example),
                self._sequence_logps(self.reference, batch.kl),
                zeros,
            )
        return pair_logps(self.reference, batch)

    def _sequence_logps(self, model: Any, view: TokenView) -> torch.Tensor:
        """Completion log-probs [B] fp32 of ``model`` on one view of the batch (graph only under grad)."""
        # apply_loss_mask=False scores every non-padding token (prompt included), as ColossalChat does.
        mask = view.loss_mask if self.apply_loss_mask else view.attention_mask
        return model_sequence_logps(model, view.input_ids, view.attention_mask, mask, self._lm_head(model))

    def _flop_params(self, model: Any) -> int:
        """N of ``model`` for the FLOPs count (coati_kto.trainer.throughput), computed once per model."""
        if id(model) not in self._params:
            self._params[id(model)] = flop_params(model)
        return self._params[id(model)]

    def _lm_head(self, model: Any) -> LMHead | None:
        """The model's LM head for the chunked path (no [B, S, V] logits), or None: the logits path.

        Gemini keeps parameters in chunks released outside the forward, so its head is used through logits.
        """
        if id(model) not in self._heads:
            gemini = type(self.plugin).__name__ == "GeminiPlugin"
            self._heads[id(model)] = None if gemini else LMHead.find(model)
        return self._heads[id(model)]

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """No gradient reduction before the step's last micro-batch, where the plugin supports it."""
        if last or not self._use_no_sync:
            return contextlib.nullcontext()
        return self.booster.no_sync(self.policy, self.optimizer)

    def _current_lr(self) -> float:
        if self.lr_scheduler is not None:
            return float(self.lr_scheduler.get_last_lr()[0])
        return float(self.optimizer.param_groups[0]["lr"])

    def _nonfinite_message(self, step: int, epoch: int, bad_grad: bool) -> str:
        last = self.checkpoint_manager.resolve("auto") if self.checkpoint_manager is not None else None
        kept = f"the last good checkpoint is {last}" if last else "no checkpoint was saved"
        what = "gradient norm" if bad_grad else "KTO loss"
        return (
            f"non-finite (NaN/inf) {what} at optimizer step {step} (epoch {epoch}); stopped before updating "
            f"the weights, {kept}. Lower train.lr, check the data, or set train.on_nonfinite=skip"
        )

    # ---------------------------------------------------------------- evaluation
    def _eval(self, epoch: int) -> None:
        """The epoch-end evaluation, when ``eval_at_epoch_end`` asks for it."""
        if not self.eval_at_epoch_end:
            return
        if self._eval_loader is not None and self._last_eval_step != self.global_step:
            self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        """The eval set once, all ranks: exact sums over valid rows, one z0 over the whole set. Every rank calls."""
        if self._eval_loader is None:
            return {}
        started = time.perf_counter()
        self.policy.eval()
        try:
            sums = self._forward([iter(self._eval_loader)], train=False)
        finally:
            self.policy.train()
        local, kl = sums.local()
        totals = reduce_sums(local, self.layout.dp_group)
        seconds = time.perf_counter() - started
        metrics = {f"eval/{k}": v for k, v in summarize(totals, kl).items()}
        metrics["eval/examples_per_second"] = totals["examples"] / seconds
        metrics["eval/tokens_per_second"] = totals["tokens"] / seconds
        metrics["eval/model_flops_per_second"] = totals["model_flops"] / seconds
        self._record(metrics)
        self._last_eval_step = self.global_step
        if self._progress is not None and "eval/loss" in metrics:
            self._progress.write(f"step {self.global_step}: eval loss {metrics['eval/loss']:.4f}")
        return metrics

    # ---------------------------------------------------------------- logging / checkpoints / cleanup
    def _record(self, metrics: dict[str, float]) -> None:
        """Keep the record on every rank (tests, callers) and write it from the main rank."""
        self.history.append({"step": float(self.global_step), **metrics})
        if self._writer is not None:
            self._writer.log(metrics, self.global_step)

    def _save(self, epoch: int) -> None:
        """Checkpoint after a finite step; every rank calls. The state is this rank's data position."""
        if self.checkpoint_manager is None or self._last_saved_step == self.global_step:
            return
        sampler = getattr(self._train_loader, "batch_sampler", None)
        sampler_state = None
        if hasattr(sampler, "state_dict"):
            # The consumed count, not the sampler's own position: a DataLoader may have prefetched further.
            sampler_state = {**sampler.state_dict(), "epoch": epoch, "position": self._consumed}
        state = {
            "epoch": epoch,
            "dp_rank": self.layout.dp_rank,  # a resume on another layout reads every dp rank's position
            "global_step": self.global_step,
            "consumed": self._consumed,
            "sampler": sampler_state,
            "skipped_steps": self.skipped_steps,
            "last_eval_step": self._last_eval_step,
            "config": self.run_config,
        }
        self.checkpoint_manager.save(self.global_step, self.policy, self.optimizer, self.lr_scheduler, state)
        self._last_saved_step = self.global_step

    def _stop(self, epoch: int) -> None:
        """A voted stop request: log the open interval, checkpoint this step, raise TrainingStoppedError (every rank)."""
        if self._interval.steps:
            self._log_interval()
        self._save(epoch)
        last = self.checkpoint_manager.resolve("auto") if self.checkpoint_manager is not None else None
        raise TrainingStoppedError(
            self._stop_signal or "a stop signal", self.global_step, str(last) if last else None
        )

    def _after_fit(self) -> None:
        if self._interval.steps:  # the steps of an unfinished logging interval
            self._log_interval()
        # The final checkpoint, in the epoch of the last step (a resume from it finds no data left there).
        if self._epoch is not None:
            self._save(self._epoch)

    def _cleanup(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._writer is not None:
            self._writer.close()


def _disable_dropout(module: nn.Module) -> None:
    """Set every dropout probability of ``module`` to 0 (nn.Dropout layers and float attributes read in forward)."""
    for sub in module.modules():
        if isinstance(sub, nn.modules.dropout._DropoutNd):
            sub.p = 0.0
        for name in _DROPOUT_ATTRS:
            if isinstance(getattr(sub, name, None), float):
                setattr(sub, name, 0.0)
