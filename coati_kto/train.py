"""``coati-kto train CONFIG``: the whole run, top to bottom (every rank executes ``train``).

setup (process group, seed, data, tokenizer, plugin, models, optimizer, schedule, booster, loaders)
-> train (KTOTrainer.fit, resuming when train.resume says so) -> save (final checkpoint, HF export)
-> cleanup (writers close inside fit).

Ranks: rank 0 builds the prepared dataset if needed and writes every shared file (config.yaml, logs, the
export's files); tensor-parallel ranks of one data-parallel group get the same batches.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coati_kto.config.load import save_config
from coati_kto.config.schema import Config
from coati_kto.models.hf import load_causal_lm
from coati_kto.parallel.distributed import ParallelLayout, barrier, init_distributed, seed_everything
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.runtime.preflight import check_training
from coati_kto.runtime.run_dir import clear_previous_run
from coati_kto.runtime.signals import STOP, StopSignals
from coati_kto.runtime.watchdog import Heartbeat, new_heartbeat


@dataclass
class Components:
    """Everything ``KTOTrainer`` needs besides data; built identically on every rank."""

    plugin: Any
    booster: Any
    layout: ParallelLayout
    policy: Any  # boosted
    # frozen, eval mode, built by plan.build_reference (same path as the policy); with model.lora the policy
    # with its adapters disabled (coati_kto.models.lora.AdapterFreeReference); None with kto.reference cached
    reference: Any
    optimizer: Any  # boosted
    lr_scheduler: Any
    plan: ParallelPlan


def build_components(
    config: Config, plugin: Any, total_steps: int, plan: ParallelPlan | None = None
) -> Components:
    """Models, optimizer, cosine schedule with warmup, boosted. Every rank calls, after ``plan.build_plugin``.

    Both models load in fp32: the policy is boosted (ZeRO and the AMP optimizers keep fp32 masters; the plugin
    casts the working copy), the reference goes through the same plugin path without an optimizer
    (``ParallelPlan.build_reference``: same sharding, same cast, same fp32 rotary buffers), so at step 0 both
    give identical log-probs and the log-ratios start at exactly 0.
    """
    from colossalai.booster import Booster

    from coati_kto.parallel import compat
    from coati_kto.trainer.schedule import warmup_cosine_schedule

    plan = plan or ParallelPlan.from_config(config)
    layout = ParallelLayout.from_plugin(plugin)
    policy = load_causal_lm(config.model.path, config.model, torch.float32)
    if config.model.gradient_checkpointing:
        # Non-reentrant: shardformer's forward requires it, and it works with no_grad passes.
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    booster = Booster(plugin=plugin)
    if config.model.lora is not None:  # before boosting: the plugins wrap the PeftModel
        from coati_kto.models.lora import enable_lora

        policy = enable_lora(booster, policy, config.model.lora)
    reference = (
        None  # kto.reference cached: the batches carry its log-probs (coati_kto.trainer.reference_cache)
    )
    if config.kto.reference == "online" and config.model.lora is None:
        reference = load_causal_lm(
            config.model.reference_path or config.model.path, config.model, torch.float32
        )
        reference = plan.build_reference(plugin, reference)
    optimizer = compat.make_optimizer(policy.parameters(), config.train.lr, config.train.weight_decay)
    lr_scheduler = warmup_cosine_schedule(
        optimizer, config.train.warmup_steps, max(1, total_steps), config.train.min_lr_ratio
    )
    # Every parameter, frozen ones included: ZeRO skips them, and LowLevelZeroPlugin finds the adapters' group
    # by their base layer's parameter.
    policy, optimizer, lr_scheduler = plan.boost(booster, policy, optimizer, lr_scheduler)
    if config.model.lora is not None and config.kto.reference == "online":
        from coati_kto.models.lora import AdapterFreeReference

        reference = AdapterFreeReference(policy)  # the base model: no second copy in memory
    return Components(plugin, booster, layout, policy, reference, optimizer, lr_scheduler, plan)


def total_optimizer_steps(config: Config, micro_batches_per_rank: int) -> int:
    """Optimizer steps of the run: epochs x ceil(micro-batches / accumulation), capped by train.max_steps.

    The LR schedule spans exactly this many steps: a max_steps beyond the epochs' steps must not stretch the
    cosine over steps that never run.
    """
    per_epoch = math.ceil(micro_batches_per_rank / config.train.accumulation_steps)
    by_epochs = per_epoch * config.train.max_epochs
    return min(config.train.max_steps, by_epochs) if config.train.max_steps else by_epochs


def train(config: Config) -> Any:
    """Run KTO training as configured; returns the KTOTrainer (``history``: its last logged records).

    Every rank calls. User mistakes raise UserError subclasses (the CLI prints them on one line). SIGTERM,
    SIGINT or SIGUSR1 end the run after a checkpoint, raising TrainingStoppedError (coati_kto.runtime.signals).
    """
    check_training(config)  # before anything heavy: every problem at once
    # Installed for the rest of the process: a launcher may repeat the signal while this rank exits (torchrun
    # SIGTERMs the workers still running once one has exited), and that must not kill it mid-teardown.
    stop_signals = STOP.install()
    heartbeat = new_heartbeat(config.train.heartbeat_timeout)
    try:
        # torchrun's store exists before its workers start: watch from here, so a rank that dies before the
        # process group forms is caught too. Elsewhere rank 0 creates the store in init_distributed.
        if heartbeat is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            heartbeat.start()
        return _train(config, stop_signals, heartbeat)
    finally:
        if heartbeat is not None:
            heartbeat.stop()


def _train(config: Config, stop_signals: StopSignals, heartbeat: Heartbeat | None) -> Any:
    from coati_kto.parallel.compat import quiet_known_warnings

    quiet_known_warnings()  # before the imports below bring in colossalai
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.eval_sampler import EvalBatchSampler, ValidMaskLoader
    from coati_kto.data.prepared import load_prepared
    from coati_kto.data.sampler import MixedLabelBatchSampler
    from coati_kto.data.tokenize import pad_id
    from coati_kto.data.weights import resolve_kto_weights
    from coati_kto.trainer.checkpoint import CheckpointManager
    from coati_kto.trainer.kto import KTOTrainer
    from coati_kto.trainer.model_card import write_model_card
    from coati_kto.trainer.throughput import resolve_peak_flops

    # ---- setup
    init_distributed(timeout_s=config.train.dist_timeout)
    if heartbeat is not None and not heartbeat.is_alive():
        heartbeat.start()
    seed_everything(config.train.seed)
    output = config.training_output()
    out_dir = Path(output.dir)
    if output.overwrite:
        clear_previous_run(out_dir)  # rank 0 deletes, the others wait
    data = load_prepared(config)
    tokenizer = AutoTokenizer.from_pretrained(
        config.model.tokenizer or config.model.path, trust_remote_code=config.model.trust_remote_code
    )
    if config.kto.reference == "cached":  # computed once (all ranks) unless a matching cache exists
        from coati_kto.trainer.reference_cache import with_reference_logps

        data = with_reference_logps(config, data, pad_id(tokenizer)[0])
    plan = ParallelPlan.from_config(config)
    plugin = plan.build_plugin()
    layout = ParallelLayout.from_plugin(plugin)
    if layout.is_main:
        save_config(config, out_dir / "config.yaml")

    # Data-parallel rank, not global rank: tensor-parallel peers must see the same batches.
    sampler = MixedLabelBatchSampler(
        data.train["label"],
        config.train.micro_batch_size,
        num_replicas=layout.dp_size,
        rank=layout.dp_rank,
        seed=config.train.seed,
        drop_last=True,
        lengths=data.train["length"] if config.data.group_by_length else None,
        group_by_length=config.data.group_by_length,
    )
    collator = KTOCollator(pad_id(tokenizer)[0], config.data.pad_to_multiple_of)  # EOS when no pad token
    train_loader = DataLoader(
        data.train, batch_sampler=sampler, collate_fn=collator, num_workers=config.train.num_workers
    )
    eval_loader = None
    if data.eval is not None and len(data.eval) > 0:
        eval_sampler = EvalBatchSampler(
            len(data.eval),
            config.train.eval_micro_batch_size or config.train.micro_batch_size,
            num_replicas=layout.dp_size,
            rank=layout.dp_rank,
        )
        loader = DataLoader(
            data.eval, batch_sampler=eval_sampler, collate_fn=collator, num_workers=config.train.num_workers
        )
        eval_loader = ValidMaskLoader(loader, eval_sampler)
    desirable_weight, undesirable_weight, report = resolve_kto_weights(config, data.stats, layout.dp_size)
    if layout.is_main:
        print(report, flush=True)

    total_steps = total_optimizer_steps(config, len(sampler))
    if layout.is_main and config.train.max_steps and total_steps < config.train.max_steps:
        print(
            f"note: train.max_epochs {config.train.max_epochs} holds {total_steps} optimizer steps, fewer than "
            f"train.max_steps {config.train.max_steps}: the run ends after {total_steps}",
            flush=True,
        )
    parts = build_components(config, plugin, total_steps, plan)
    peak_flops, peak_source = resolve_peak_flops(config.train.peak_flops, config.plugin.precision)
    if layout.is_main:
        if peak_flops:
            print(f"train/mfu against {peak_flops:.4g} FLOP/s per device ({peak_source})", flush=True)
        else:
            print(f"train/mfu not logged: peak FLOP/s {peak_source}", flush=True)
    manager = CheckpointManager(out_dir / "checkpoints", parts.booster, layout, output.keep_last)
    trainer = KTOTrainer(
        actor=parts.policy,
        ref_model=parts.reference,
        booster=parts.booster,
        actor_optim=parts.optimizer,
        plugin=plugin,
        actor_lr_scheduler=parts.lr_scheduler,
        tokenizer=tokenizer,
        max_epochs=config.train.max_epochs,
        beta=config.kto.beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        accumulation_steps=config.train.accumulation_steps,
        save_interval=output.save_interval,
        layout=layout,
        loss_type=config.kto.loss_type,
        kl_scope=config.kto.kl_scope,
        max_steps=config.train.max_steps,
        eval_interval=config.train.eval_interval,
        eval_at_start=config.train.eval_at_start,
        eval_at_epoch_end=config.train.eval_at_epoch_end,
        log_interval=config.train.log_interval,
        on_nonfinite=config.train.on_nonfinite,
        max_grad_norm=config.train.max_grad_norm,
        checkpoint_manager=manager,
        run_config=config.model_dump(mode="json"),
        data_stats=data.stats,
        wandb_project=config.logging.wandb_project,
        wandb_mode=config.logging.wandb_mode,
        wandb_dir=str(out_dir),
        stop_signals=stop_signals,
        plan=plan,
        peak_flops=peak_flops,
        pack_reference=config.kto.pack_reference,
        pack_policy=config.kto.policy_packing(),
    )
    checkpoint = manager.resolve_everywhere(config.train.resume)  # rank 0 decides, every rank follows
    if checkpoint is not None:
        trainer.resume(checkpoint)
        if layout.is_main:
            print(f"resumed from {checkpoint} at optimizer step {trainer.global_step}", flush=True)

    # ---- train (checkpoints every output.save_interval steps and at the end)
    trainer.fit(
        train_loader,
        eval_loader,
        log_dir=str(out_dir / "tensorboard") if config.logging.tensorboard else None,
        use_wandb=config.logging.wandb,
    )

    # ---- save
    if output.save_final:
        if config.model.lora is not None:  # final/adapter (peft) and, with output.merge_lora, final/merged
            from coati_kto.models.lora import export_lora

            final = export_lora(parts.policy, tokenizer, out_dir / "final", layout.is_main, output.merge_lora)
        else:
            final = manager.export_hf(parts.policy, tokenizer, out_dir / "final")
        if layout.is_main:
            weights = (desirable_weight, undesirable_weight)
            write_model_card(
                final, config, data.stats, trainer.history, trainer.global_step, weights, layout.world_size
            )
            print(f"final model: {final}", flush=True)
    barrier()
    return trainer
