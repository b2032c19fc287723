"""``coati-kto train CONFIG``: the whole run, top to bottom (every rank executes ``train``).

setup (process group, seed, data, tokenizer, plugin, models, optimizer, schedule, booster, loaders)
-> train (KTOTrainer.fit, resuming when train.resume says so) -> save (final checkpoint, HF export)
-> cleanup (writers close inside fit).

Ranks: rank 0 builds the prepared dataset if needed and writes every shared file (config.yaml, logs, the
export's files); tensor-parallel ranks of one data-parallel group get the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from coati_kto.config import Config, ModelSection, save_config
from coati_kto.distributed import ParallelLayout, barrier, init_distributed, seed_everything


@dataclass
class Components:
    """Everything ``KTOTrainer`` needs besides data; built identically on every rank."""

    plugin: Any
    booster: Any
    layout: ParallelLayout
    policy: Any  # boosted
    reference: torch.nn.Module | None  # frozen, eval mode, not boosted
    optimizer: Any  # boosted
    lr_scheduler: Any


def training_dtype(precision: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def load_causal_lm(path: str, model_cfg: ModelSection, dtype: torch.dtype) -> torch.nn.Module:
    """A Hugging Face causal LM. Dropout is switched off on the modules by KTOTrainer, not in the config, so
    the exported model keeps the user's config."""
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": model_cfg.attn_implementation} if model_cfg.attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(
        path, torch_dtype=dtype, trust_remote_code=model_cfg.trust_remote_code, **extra
    )


def build_components(config: Config, plugin: Any, total_steps: int) -> Components:
    """Models, optimizer, cosine schedule with warmup, boosted. Every rank calls, after ``build_plugin``.

    The policy loads in fp32 (ZeRO and the AMP optimizers keep fp32 masters; the plugin casts the working
    copy). The reference model is not boosted (DDP refuses a module without trainable parameters): it is
    frozen, in eval mode, on the training device and in the training dtype, so at initialisation it matches
    the policy's working copy and the log-ratios start at 0.
    """
    from colossalai.accelerator import get_accelerator
    from colossalai.booster import Booster
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    from coati_kto import compat

    layout = ParallelLayout.from_plugin(plugin)
    policy = load_causal_lm(config.model.path, config.model, torch.float32)
    if config.model.gradient_checkpointing:
        # Non-reentrant: shardformer's forward requires it, and it works with no_grad passes.
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = None  # kto.reference cached: the batches carry its log-probs (coati_kto.reference_cache)
    if config.kto.reference == "online":
        reference = load_causal_lm(
            config.model.reference_path or config.model.path,
            config.model,
            training_dtype(config.plugin.precision),
        )
        reference = reference.to(get_accelerator().get_current_device()).eval().requires_grad_(False)
    optimizer = compat.make_optimizer(policy.parameters(), config.train.lr, config.train.weight_decay)
    lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=config.train.warmup_steps,
        num_training_steps=max(1, total_steps),
        min_lr_rate=config.train.min_lr_ratio,
    )
    booster = Booster(plugin=plugin)
    policy, optimizer, _, _, lr_scheduler = booster.boost(policy, optimizer, lr_scheduler=lr_scheduler)
    return Components(plugin, booster, layout, policy, reference, optimizer, lr_scheduler)


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

    Every rank calls. User mistakes raise UserError subclasses (the CLI prints them on one line).
    """
    from coati_kto.compat import quiet_known_warnings

    quiet_known_warnings()  # before the imports below bring in colossalai
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from coati_kto.data.collator import KTOCollator
    from coati_kto.data.eval_sampler import EvalBatchSampler, ValidMaskLoader
    from coati_kto.data.prepare import load_prepared, resolve_kto_weights
    from coati_kto.data.sampler import MixedLabelBatchSampler
    from coati_kto.plugins import build_plugin
    from coati_kto.trainer.checkpoint import CheckpointManager
    from coati_kto.trainer.kto import KTOTrainer
    from coati_kto.trainer.throughput import resolve_peak_flops

    # ---- setup
    init_distributed(timeout_s=config.train.dist_timeout)
    seed_everything(config.train.seed)
    out_dir = Path(config.output.dir)
    data = load_prepared(config)
    tokenizer = AutoTokenizer.from_pretrained(
        config.model.tokenizer or config.model.path, trust_remote_code=config.model.trust_remote_code
    )
    if config.kto.reference == "cached":  # computed once (all ranks) unless a matching cache exists
        from coati_kto.reference_cache import with_reference_logps

        data = with_reference_logps(config, data, tokenizer.pad_token_id)
    plugin = build_plugin(
        config.plugin,
        config.train.max_grad_norm,
        flash_attention=config.model.attn_implementation == "flash_attention_2",
    )
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
    collator = KTOCollator(tokenizer.pad_token_id, config.data.pad_to_multiple_of)
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
    parts = build_components(config, plugin, total_steps)
    peak_flops, peak_source = resolve_peak_flops(config.train.peak_flops, config.plugin.precision)
    if layout.is_main:
        if peak_flops:
            print(f"train/mfu against {peak_flops:.4g} FLOP/s per device ({peak_source})", flush=True)
        else:
            print(f"train/mfu not logged: peak FLOP/s {peak_source}", flush=True)
    manager = CheckpointManager(out_dir / "checkpoints", parts.booster, layout, config.output.keep_last)
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
        save_interval=config.output.save_interval,
        layout=layout,
        kl_scope=config.kto.kl_scope,
        max_steps=config.train.max_steps,
        eval_interval=config.train.eval_interval,
        log_interval=config.train.log_interval,
        on_nonfinite=config.train.on_nonfinite,
        checkpoint_manager=manager,
        run_config=config.model_dump(mode="json"),
        wandb_project=config.logging.wandb_project,
        wandb_mode=config.logging.wandb_mode,
        wandb_dir=str(out_dir),
        peak_flops=peak_flops,
    )
    checkpoint = manager.resolve(config.train.resume)
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
    if config.output.save_final:
        final = manager.export_hf(parts.policy, tokenizer, out_dir / "final")
        if layout.is_main:
            print(f"final model: {final}", flush=True)
    barrier()
    return trainer
