"""KTOTrainer: KTO (Ethayarajh et al. 2024) on a ColossalAI Booster, read top to bottom.

One optimizer step (``_train_step``) on every rank:

1. no-grad passes over each micro-batch of the step (coati_kto.trainer.passes, as the micro-batch's scoring
   plan says: coati_kto.trainer.scoring_plan): the policy on the KL pairs, the reference on the examples and
   their KL pairs, or the batch's precomputed reference log-probs;
2. the reference point z0 from the KL log-ratios of every micro-batch of the step on every data-parallel rank
   (``kto.kl_scope: step``; ``micro_batch``: one z0 per accumulation micro-batch, over all ranks). With
   ``loss_type="apo_zero_unpaired"`` there is no z0: the KL-pair passes and this collective are skipped;
3. the policy pass with gradient per micro-batch (``micro.loss()``), the KTO loss, ``booster.backward`` of
   sum(per-example loss) / (rows x micro-batches in the step): the plugins average gradients over the
   data-parallel ranks, so the gradient is that of the mean per-example loss over the global batch, whatever
   the layout. Under pipeline parallelism steps 1-3 are schedule runs (coati_kto.trainer.pipeline);
4. one all-reduce of the step's metric sums, which also carries this rank's share of the squared global
   gradient norm (coati_kto.parallel.grad_norm) and so the non-finite vote on loss AND gradient: every rank
   decides to step, skip or stop identically, before any weight changes; then the optimizer steps, clipping
   with that norm (no second norm computation), and the LR scheduler steps.

Evaluation runs the same passes without gradient, with one z0 over the whole eval set: at fit start
(``eval_at_start``, the baseline, unless that step was already evaluated), every ``eval_interval`` steps and
at each epoch end (``eval_at_epoch_end``).

Every collective has the same shape and dtype on every rank whatever its labels: the loss picks its branch with
a label mask, z0 reduces a fixed [sum, count] pair, metrics a fixed set of sums.

Dropout: KTO's log-ratios compare the policy with the reference, so both must be deterministic: the policy stays
in train mode (gradient checkpointing needs it) with every dropout probability 0, the reference in eval mode (the
model configs are untouched, so the exported model keeps them).

Gradient accumulation reduces gradients at a step's last micro-batch only where the backend allows no_sync
(``ParallelBackend.no_sync_accumulation``); ZeRO-2 refuses it and reduce-scatters every backward into its buffers.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from colossalai.accelerator import get_accelerator

from coati_kto.data.batch import KTOBatch
from coati_kto.errors import NonFiniteLossError
from coati_kto.models.compile import compile_metrics
from coati_kto.models.hf import without_dropout
from coati_kto.parallel.distributed import ParallelLayout, reduce_sums
from coati_kto.parallel.grad_norm import global_norm
from coati_kto.parallel.loss_scale import skipped_by_loss_scaler
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.runtime.signals import StopSignals, TrainingStoppedError, decide
from coati_kto.trainer.base import SLTrainer
from coati_kto.trainer.checkpoint import CheckpointManager
from coati_kto.trainer.logging import MetricWriter, ProgressBar, warn_nonfinite_eval, warn_skipped_step
from coati_kto.trainer.metrics import IntervalMeter, StepSums, evaluated, summarize
from coati_kto.trainer.options import KTOOptions, options_from
from coati_kto.trainer.passes import KTOPasses
from coati_kto.trainer.pipeline import PipelinePasses
from coati_kto.trainer.position import DataPosition
from coati_kto.trainer.run_state import log_resumed_step, restore_run_state, run_state
from coati_kto.trainer.samples import EvalSamples
from coati_kto.trainer.schedule import current_lr, planned_steps
from coati_kto.trainer.throughput import mfu

HISTORY_LENGTH = 10_000  # logged records kept in memory (TensorBoard/W&B hold the full run)
_GRAD_SQ = "grad_sq"  # this rank's share of the squared gradient norm, in the step's metric all-reduce


class KTOTrainer(SLTrainer):
    """KTO on a boosted policy, a frozen reference model and a dataloader of the batch contract.

    The positional parameters are ColossalChat's KTOTrainer's (``actor`` is the policy, ``ref_model`` the
    reference); ``coordinator`` is accepted for that signature and unused (ranks come from ``layout``). The
    run's settings are one ``KTOOptions``: ``options``, or built from ColossalChat's positional settings and
    keywords (``trainer.options.options_from``; never both). The collaborators are keyword-only. Every rank
    constructs it and calls ``fit``.

    Batches are :class:`~coati_kto.data.batch.KTOBatch` (tensors on any device): the examples and their KL
    pairs as two token views, labels, and optionally precomputed reference log-probs (the reference model may
    then be None) and ``valid`` (evaluation padding rows are False and count nowhere).

    Collaborators: ``layout`` and ``plan`` (default: from ``plugin``; its backend answers every plugin question),
    ``checkpoint_manager`` (default: one under ``save_dir``), ``run_config`` (the resolved config as a dict:
    stored in checkpoints, sent to W&B, written to TensorBoard), ``data_stats`` (stats.json, TensorBoard text),
    ``stop_signals`` (a voted stop checkpoints and raises TrainingStoppedError on every rank).
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
        max_epochs: int | None = None,
        beta: float | None = None,
        desirable_weight: float | None = None,
        undesirable_weight: float | None = None,
        apply_loss_mask: bool | None = None,
        accumulation_steps: int | None = None,
        start_epoch: int = 0,
        save_interval: int | None = None,
        save_dir: str | None = None,
        coordinator: Any = None,
        *,
        options: KTOOptions | None = None,
        layout: ParallelLayout | None = None,
        plan: ParallelPlan | None = None,
        checkpoint_manager: CheckpointManager | None = None,
        run_config: dict | None = None,
        data_stats: dict | None = None,
        stop_signals: StopSignals | None = None,
        **settings: Any,
    ) -> None:
        positional = {"max_epochs": max_epochs, "beta": beta, "desirable_weight": desirable_weight}
        positional |= {"undesirable_weight": undesirable_weight, "apply_loss_mask": apply_loss_mask}
        positional |= {"accumulation_steps": accumulation_steps, "save_interval": save_interval}
        self.options = options_from(options, {**positional, **settings})  # ColossalChat's signature adapted
        super().__init__(booster, self.options.max_epochs, actor, actor_optim, plugin, start_epoch)
        self.policy, self.reference = actor, ref_model
        self.lr_scheduler, self.tokenizer = actor_lr_scheduler, tokenizer
        self.accumulation_steps = self.options.accumulation_steps
        self.save_interval = self.options.save_interval
        self.layout = layout or ParallelLayout.from_plugin(plugin)
        self.plan = plan or ParallelPlan.from_plugin(plugin)  # everything plugin-specific: plan.backend
        if checkpoint_manager is None and save_dir is not None:
            checkpoint_manager = CheckpointManager(
                Path(save_dir), booster, self.layout, self.options.keep_last
            )
        self.checkpoint_manager = checkpoint_manager
        self.run_config, self.data_stats = run_config, data_stats
        self.stop_signals = stop_signals or StopSignals()  # not installed: never votes to stop
        self._stop_signal: str | None = None
        self._wandb_dir = self.options.wandb_dir or save_dir or "."
        self.device = get_accelerator().get_current_device()
        kl_group = self.plan.kl_group(self.layout)
        self.passes = KTOPasses(actor, ref_model, self.plan, self.options, kl_group, self.device)
        self._use_no_sync = plugin is not None and self.plan.backend.no_sync_accumulation
        self._grad_norm = self.plan.backend.grad_norm(actor_optim, self.layout, self.options.max_grad_norm)
        self.pipeline = self._pipeline(kl_group)
        self._init_run_state()
        without_dropout(self.policy, self.reference)

    def _pipeline(self, kl_group: Any) -> PipelinePasses | None:
        """Under pipeline parallelism the step's passes and backward are schedule runs (coati_kto.trainer.pipeline);
        the gradient norm counts a tied weight held by two stages once."""
        if self.layout.pp_size == 1:
            return None
        args = (self.policy, self.reference, self.booster, self.optimizer, self.layout, self.options)
        pipeline = PipelinePasses(*args, kl_group, self.device)
        self._grad_norm.counted_elsewhere(pipeline.tied_copies())
        return pipeline

    def _init_run_state(self) -> None:
        """Counters, the data position and the writers: what fit advances and a checkpoint records."""
        self.skipped_steps = 0
        self.history: deque[dict[str, float]] = deque(maxlen=HISTORY_LENGTH)  # last logged records, all ranks
        self.pushed: bool | None = None  # output.push_to_hub's upload of final/ (set by coati_kto.train)
        self.position = DataPosition(self.accumulation_steps)
        self._last_lr = float("nan")
        self._last_saved_step: int | None = None
        self._last_eval_step: int | None = None
        self._save_after_eval = False  # a checkpoint due at the epoch's last step, before its evaluation
        self._interval = IntervalMeter()
        self._writer: MetricWriter | None = None
        self._progress: ProgressBar | None = None
        self._samples: EvalSamples | None = None  # eval.samples: decoded at every evaluation
        self._tensorboard_at_resume: list | None = None  # what the checkpoint's step wrote (run_state.py)

    # ---------------------------------------------------------------- resume / setup
    def resume(self, checkpoint: str | Path, export: bool = False) -> None:
        """Restore model, optimizer, scheduler, RNG and the step/epoch/data position; every rank calls, before fit.

        ``export=True`` (``coati-kto export``): the weights and step only; the run directory is only read (its
        ``latest`` pointer is left alone) and the RNG states, which no export uses, are not restored."""
        if self.checkpoint_manager is None:
            raise ValueError("resume needs a checkpoint_manager (or save_dir)")
        manager = self.checkpoint_manager
        state = manager.load(Path(checkpoint), self.policy, self.optimizer, self.lr_scheduler, rng=not export)
        restore_run_state(self, state)
        if not export:
            manager.resumed_from(Path(checkpoint))

    def _before_fit(
        self, train_dataloader: Any, eval_dataloader: Any, log_dir: str | None, use_wandb: bool
    ) -> None:
        self._train_loader, self._eval_loader = train_dataloader, eval_dataloader
        left = self.position.left_in_epoch(train_dataloader)  # None unless resuming
        resumed = None if left is None else (self.global_step, *left)
        total = planned_steps(
            len(train_dataloader), self.accumulation_steps, self.max_epochs, self.options.max_steps, resumed
        )
        options = self.options
        wandb = None
        if use_wandb:
            wandb = {"project": options.wandb_project, "mode": options.wandb_mode, "dir": self._wandb_dir}
            wandb.update(config=self.run_config, resume=resumed is not None)
        kept = self._tensorboard_at_resume
        purge = self.global_step + (kept is None) if resumed else None
        self._writer = MetricWriter(self.layout.is_main, log_dir, purge_step=purge, wandb_settings=wandb)
        log_resumed_step(self)  # the checkpoint step's writes again (run_state.py)
        self._progress = ProgressBar(self.layout.is_main, total, initial=self.global_step)
        self._writer.run_summary(self.run_config, self.data_stats, self.global_step)
        self._samples = EvalSamples.for_run(self, eval_dataloader)
        self.policy.train()
        if (
            self.options.eval_at_start
            and self._eval_loader is not None
            and self._last_eval_step != self.global_step
        ):
            self._evaluate()  # the baseline: every eval/ curve starts from the model the run began with

    def _finished(self) -> bool:
        return self.options.max_steps is not None and self.global_step >= self.options.max_steps

    # ---------------------------------------------------------------- training
    def _train(self, epoch: int) -> None:
        for micro_batches in self.position.steps(self._train_loader, epoch):
            self._train_step(micro_batches, epoch)
            if self.options.eval_interval and self.global_step % self.options.eval_interval == 0:
                self._evaluate()
            # The last step, with the end's evaluation to come, is saved after it (_after_fit): a resume from the
            # checkpoint then does not evaluate that step again.
            before_end_eval = (self._finished() or self.position.at_epoch_end()) and self._end_eval_due()
            self._save_after_eval = bool(self.save_interval) and self.global_step % self.save_interval == 0
            if self._save_after_eval and not before_end_eval:
                self._save(epoch)
            if self._stop_signal is not None:
                self._stop(epoch)
            if self._finished():
                break

    def _train_step(self, micro_batches: list[KTOBatch], epoch: int) -> None:
        started = time.perf_counter()
        step = self.global_step + 1
        groups = [micro_batches] if self.options.kl_scope == "step" else [[b] for b in micro_batches]
        sums = StepSums(self.device)
        if self.pipeline is not None:  # both phases through the schedule, its gradient sync included
            self.pipeline.train_step(groups, sums)
        else:
            for micro in self.passes.train_step(groups, sums):  # each after its group's no-grad passes and z0
                with self._grad_sync(micro.last):
                    self.booster.backward(micro.loss(), self.optimizer)
        local, kl_local = sums.local_tensors()
        local[_GRAD_SQ] = self._grad_norm.local_share()
        # The step's one collective and host sync: "nonfinite", the norm and stop keys are the votes; z0 rides along.
        # A row counts once (ParallelLayout.sums_group); the norm's share is already summed over tp, sp and stages.
        group, counted = self.layout.sums_group()
        totals = reduce_sums(local, group, kl_local, self.stop_signals.vote(), counted)
        kl = {k: totals.pop(k) for k in kl_local} if kl_local else None
        self._stop_signal = decide(totals)
        norm = global_norm(totals.pop(_GRAD_SQ))
        bad_grad = not math.isfinite(norm) and not self._grad_norm.loss_scaled
        grad_norm, overflowed = None, False
        skipped = totals["nonfinite"] > 0 or bad_grad
        if skipped:
            self.optimizer.zero_grad()
            bad_grad = totals["nonfinite"] == 0  # the cause named: a NaN loss makes a NaN norm too
            if self.options.on_nonfinite == "stop":
                manager = self.checkpoint_manager
                raise NonFiniteLossError.at(step, epoch, bad_grad, manager and manager.resume_auto_here())
            self.skipped_steps += 1
            warn_skipped_step(self.layout.is_main, step, epoch, bad_grad, self.skipped_steps)
        else:
            # Unscaled before the step: inside it the fp16 loss scaler may grow the scale for the next step.
            grad_norm = self._grad_norm.unscaled(norm) if math.isfinite(norm) else None
            self._grad_norm.step(norm)  # fp16: the loss scaler may still skip an overflowing step here
            self.optimizer.zero_grad()
            overflowed = skipped_by_loss_scaler(self.optimizer)  # fp16: no update, but its sums are finite
            self.skipped_steps += overflowed
        lr = current_lr(self.optimizer, self.lr_scheduler)
        if self.lr_scheduler is not None and not overflowed:
            # Held on a step the fp16 loss scaler skipped, as transformers' Trainer holds it (from 2**32 ZeRO's
            # scaler skips its first ~18 steps: the warmup spent on no update). Advanced on a non-finite skip. The
            # scheduler's own count is checkpointed (lr_scheduler.pt): resume stays exact.
            self.lr_scheduler.step()
        self.global_step = step
        self.position.consumed += len(micro_batches)

        seconds, graphs = time.perf_counter() - started, compile_metrics(self.policy)  # model.compile only
        if skipped:
            # A skipped step's sums may be NaN: they stay out of the interval, which counts the step only.
            self._interval.skip(seconds)
            step_metrics: dict[str, float] = {}
        else:
            self._interval.add(totals, kl, seconds, grad_norm, skipped=overflowed)
            step_metrics = {f"train/{k}": v for k, v in (summarize(totals, kl) | graphs).items()}
        if self._progress is not None:
            self._progress.update(step_metrics)
        self._last_lr = lr
        if step % self.options.log_interval == 0:
            self._log_interval()

    def _log_interval(self) -> None:
        metrics = {f"train/{k}": v for k, v in self._interval.summary().items()}
        metrics.update({"train/lr": self._last_lr, "train/skipped_steps": float(self.skipped_steps)})
        if (epochs := self.position.epochs()) is not None:  # TRL's fractional epoch, at the interval's end
            metrics["train/epoch"] = epochs
        devices = self.layout.world_size
        flops = metrics.get("train/model_flops_per_second")  # none in an interval of skipped steps only
        utilisation = mfu(flops, self.options.peak_flops, devices) if flops is not None else None
        if utilisation is not None:
            metrics["train/mfu"] = utilisation
        self._record(metrics)
        self._interval.reset()

    def _grad_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """No gradient reduction before the step's last micro-batch, where the plugin supports it."""
        if last or not self._use_no_sync:
            return contextlib.nullcontext()
        return self.booster.no_sync(self.policy, self.optimizer)

    # ---------------------------------------------------------------- evaluation
    def _eval(self, epoch: int) -> None:
        """The epoch-end evaluation, when ``eval_at_epoch_end`` asks for it."""
        if self._end_eval_due():
            self._evaluate()

    def _end_eval_due(self) -> bool:
        """Whether the epoch-end evaluation would evaluate this step (not evaluated yet)."""
        at_end, loader = self.options.eval_at_epoch_end, self._eval_loader
        return bool(at_end and loader is not None and self._last_eval_step != self.global_step)

    def _evaluate(self) -> dict[str, float]:
        """The eval set once, all ranks: exact sums over valid rows, one z0 over the whole set. Every rank calls."""
        if self._eval_loader is None:
            return {}
        started = time.perf_counter()
        self.policy.eval()
        try:
            sums = (self.pipeline or self.passes).evaluate(iter(self._eval_loader))
        finally:
            self.policy.train()
        local, kl = sums.local()
        group, counted = self.layout.sums_group()
        totals = reduce_sums(local, group, count_values=counted)  # the evaluation: one interval of the meter
        metrics = {f"eval/{k}": v for k, v in evaluated(totals, kl, time.perf_counter() - started).items()}
        warn_nonfinite_eval(self.layout.is_main, self.global_step, totals, kl)  # no means: say why
        if self._samples is not None:  # after the metrics' timing; the policy decodes in eval mode
            metrics.update(self._samples.write(self.policy, self.reference, self.passes, self.global_step))
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
        """Checkpoint after a finite step (every rank): its data position, the digests config.resume checks."""
        if self.checkpoint_manager is None or self._last_saved_step == self.global_step:
            return
        state = run_state(self, epoch)
        self.checkpoint_manager.save(self.global_step, self.policy, self.optimizer, self.lr_scheduler, state)
        self._last_saved_step = self.global_step

    def _stop(self, epoch: int) -> None:
        """A voted stop request: checkpoint this step, log the open interval (after: the checkpoint keeps it whole for
        the resumed run, whose TensorBoard purges this partial record), raise TrainingStoppedError (every rank)."""
        self._save(epoch)
        if self._interval.steps:
            self._log_interval()
        last = self.checkpoint_manager.resume_auto_here() if self.checkpoint_manager is not None else None
        self.stop_signals.stopped_with(name := str(last) if last else None)
        raise TrainingStoppedError(self._stop_signal or "a stop signal", self.global_step, name)

    def _after_epoch(self, epoch: int) -> None:
        if self._save_after_eval:  # the epoch's last step, saved once its evaluation is recorded
            self._save(epoch)

    def _after_fit(self) -> None:
        if self._interval.steps:  # the steps of an unfinished logging interval
            self._log_interval()
        # A stop signal after the last step's vote (during the end's evaluation) announced a checkpoint and exit
        # 75: that, rather than what follows (final/, minutes for a large model, past a scheduler's kill-wait).
        # The resumed run finds the step limit reached and writes final/. One more vote: every rank is here.
        group, counted = self.layout.sums_group()
        self._stop_signal = decide(reduce_sums({}, group, None, self.stop_signals.vote(), counted))
        # The final checkpoint, in the epoch of the last step (a resume from it finds no data left there).
        if self.position.epoch is not None:
            self._save(self.position.epoch)
            if self._stop_signal is not None:
                self._stop(self.position.epoch)

    def _cleanup(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._writer is not None:
            self._writer.close()
