"""The models, optimizer and schedule of a run, boosted, and the KTOTrainer that steps them (every rank).

``build_components`` loads the policy (and the online reference), builds the optimizer and the warmup-decay
schedule and boosts them through the run's backend. ``build_trainer`` builds those for a ``Run`` and hands them to
a KTOTrainer with its checkpoint manager and one ``KTOOptions`` (``trainer_options``): what both ``coati-kto
train`` and ``coati-kto export`` step or load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from coati_kto.config.resume import saved_holds_apart
from coati_kto.config.schema import Config
from coati_kto.errors import ConfigError, UserError
from coati_kto.families import vision_language
from coati_kto.models.compile import maybe_compile
from coati_kto.models.hf import freeze_vision_tower, load_causal_lm
from coati_kto.models.lora import AdapterFreeReference, enable_lora
from coati_kto.models.packing import padding_free_note
from coati_kto.models.vision import tower_trainable
from coati_kto.parallel.distributed import ParallelLayout
from coati_kto.parallel.model_shape import cast_rounds
from coati_kto.parallel.optimizers import optimizer_for
from coati_kto.parallel.plan import ParallelPlan
from coati_kto.recipe.setup import Run
from coati_kto.runtime.run_dir import CHECKPOINTS_DIR
from coati_kto.runtime.signals import StopSignals
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.schedule import planned_steps, warmup_decay_schedule
from coati_kto.trainer.throughput import peak_flops_line, resolve_peak_flops


@dataclass
class Components:
    """Everything ``KTOTrainer`` needs besides data; built identically on every rank."""

    plugin: Any
    booster: Any
    layout: ParallelLayout
    policy: Any  # boosted
    # frozen, eval mode, built by plan.backend.build_reference (same path as the policy); with model.lora the policy
    # with its adapters disabled (coati_kto.models.lora.AdapterFreeReference); None with kto.reference cached
    reference: Any
    optimizer: Any  # boosted
    lr_scheduler: Any
    plan: ParallelPlan
    # main rank, output.export_dtype fp32: a vision-language model's frozen tower as loaded (no masters hold it)
    frozen_fp32: dict[str, torch.Tensor]


def build_components(
    config: Config,
    plugin: Any,
    total_steps: int,
    plan: ParallelPlan | None = None,
    groups_from: dict | None = None,
) -> Components:
    """Models, optimizer, lr schedule with warmup, boosted. Every rank calls, after ``plan.backend.build_plugin``.
    ``groups_from``: the trainer state of the checkpoint the run continues or exports (``Run.resume``), whose
    optimizer grouping the config leaves open (:func:`_resumed_apart`); None: none.

    Both models load in fp32: the policy is boosted (ZeRO and the AMP optimizers keep fp32 masters; the plugin
    casts the working copy), the reference goes through the same plugin path without an optimizer
    (``ParallelBackend.build_reference``: same sharding, same cast, same fp32 rotary buffers), so at step 0 both
    give identical log-probs and the log-ratios start at exactly 0.
    """
    from colossalai.booster import Booster

    plan = plan or ParallelPlan.from_config(config)
    layout = ParallelLayout.from_plugin(plugin)
    # None with kto.reference cached: the batches carry its log-probs (coati_kto.reference.cache). The online
    # reference is placed on its devices before the policy loads: a rank's host memory holds one fp32 copy of the
    # model at a time, not two (memory_plan.load_host_bytes).
    reference = None
    if config.kto.reference == "online" and config.model.lora is None:
        reference = load_causal_lm(
            config.model.reference_path or config.model.path, config.model, torch.float32
        )
        reference = plan.backend.build_reference(plugin, maybe_compile(reference, config.model.compile))
    policy = load_causal_lm(config.model.path, config.model, torch.float32)
    # A vision-language model's tower stays frozen unless model.train_vision (model_notes says which).
    fp32_export = config.output is not None and config.output.export_dtype == "fp32"
    frozen_fp32 = {}
    if not config.model.train_vision:
        frozen_fp32 = freeze_vision_tower(policy, keep_fp32=fp32_export and layout.is_main)
    elif not vision_language(policy.config):  # a hub id: config.json was not there to check
        raise ConfigError(
            f"model.train_vision: model.path {config.model.path} is a text-only model (no vision tower to train)"
        )
    if config.model.gradient_checkpointing:  # non-reentrant: shardformer's forward requires it
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy = maybe_compile(policy, config.model.compile)  # after checkpointing, before boosting
    booster = Booster(plugin=plugin)
    if config.model.lora is not None:  # before boosting: the plugins wrap the PeftModel
        policy = enable_lora(booster, policy, config.model.lora)
    train = config.train
    optimizer = optimizer_for(policy, train, config.plugin.cpu_offload, _resumed_apart(config, groups_from))
    lr_scheduler = warmup_decay_schedule(
        optimizer, train.warmup_steps, max(1, total_steps), train.min_lr_ratio, train.lr_schedule
    )
    # Every parameter, frozen ones too: ZeRO skips them; a ZeRO plugin finds adapters by their base layer.
    # model.train_vision: a micro-batch of text records only never runs the tower (no gradient on that rank)
    unreached = vision_language(getattr(policy, "config", None)) and tower_trainable(policy)
    rounds = _cast_rounds(config)
    policy, optimizer, lr_scheduler = plan.backend.boost(
        booster, policy, optimizer, lr_scheduler, unreached, rounds
    )
    if config.model.lora is not None and config.kto.reference == "online":
        reference = AdapterFreeReference(policy)  # the base model: no second copy in memory
    return Components(plugin, booster, layout, policy, reference, optimizer, lr_scheduler, plan, frozen_fp32)


def _resumed_apart(config: Config, state: dict | None) -> bool:
    """Whether the checkpoint this run continues or exports (``state``: its trainer state) held biases and norm
    weights in a group of their own, where this run's grouping depends on it: at weight decay 0, with neither
    LoRA nor decay_norms_and_biases (config.train.separates_no_decay). False when there is none (the resume
    says why)."""
    train = config.train
    if train.weight_decay > 0 or train.decay_norms_and_biases or config.model.lora:
        return False
    return state is not None and saved_holds_apart(state)


def _cast_rounds(config: Config) -> bool:
    """Whether the plugin's cast rounds the policy's trained values (model_shape.cast_rounds); True where its
    checkpoint cannot be read here (the masters are then written from the loaded values: right either way), and
    under LoRA: the adapters are made in fp32 by peft, whatever dtype the base model is stored in."""
    if config.model.lora is not None:
        return config.plugin.precision != "fp32"
    try:
        return cast_rounds(config.model.path, config.plugin.precision)
    except UserError:
        return config.plugin.precision != "fp32"


def total_optimizer_steps(
    config: Config, micro_batches_per_rank: int, resumed: tuple[int, int, int] | None = None
) -> int:
    """The run's optimizer steps under ``config`` (``trainer.schedule.planned_steps``)."""
    train = config.train
    return planned_steps(
        micro_batches_per_rank, train.accumulation_steps, train.max_epochs, train.max_steps, resumed
    )


def trainer_options(
    config: Config, weights: tuple[float, float] | None = None, peak_flops: float | None = None
) -> KTOOptions:
    """The KTOTrainer options of a run of ``config``. ``weights``: the (lambda_D, lambda_U) resolved for this
    data-parallel layout (``Run.weights``; default: kto's configured ones); ``peak_flops``: as resolved for this
    device."""
    train, kto, output, logging, evaluation = (
        config.train,
        config.kto,
        config.training_output(),
        config.logging,
        config.eval,
    )
    desirable, undesirable = weights or (kto.desirable_weight, kto.undesirable_weight)
    return KTOOptions(
        beta=kto.beta,
        desirable_weight=desirable,
        undesirable_weight=undesirable,
        loss_type=kto.loss_type,
        max_epochs=train.max_epochs,
        accumulation_steps=train.accumulation_steps,
        save_interval=output.save_interval,
        kl_scope=kto.kl_scope,
        max_steps=train.max_steps,
        eval_interval=train.eval_interval,
        eval_at_start=train.eval_at_start,
        eval_at_epoch_end=train.eval_at_epoch_end,
        log_interval=train.log_interval,
        on_nonfinite=train.on_nonfinite,
        max_grad_norm=train.max_grad_norm,
        peak_flops=peak_flops,
        pack_reference=kto.pack_reference,
        pack_policy=kto.policy_packing(),
        kl_continuation=kto.kl_continuation,
        reference_is_policy_weights=config.model.reference_path is None,
        router_aux_loss_coef=kto.router_aux_loss_coef,
        wandb_project=logging.wandb_project,
        wandb_mode=logging.wandb_mode,
        wandb_dir=output.dir,
        keep_last=output.keep_last,
        samples=evaluation.samples,
        sample_max_new_tokens=evaluation.sample_max_new_tokens,
        sample_seed=evaluation.sample_seed,
    )


def build_trainer(
    config: Config, run: Run, stop: StopSignals, announce: bool = True
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Models, optimizer, schedule and the KTOTrainer of ``run`` (every rank); with it ``Components.frozen_fp32``.
    With ``kto.reference: cached`` no reference model is built (``coati-kto export`` asks for that, and
    ``announce=False``: no lines about how training will run). Its optimizer is grouped as ``run.resume``'s
    checkpoint was where the config leaves that open, and its checkpoints record ``run.reference_weights``."""
    from coati_kto.trainer.checkpoint import CheckpointManager  # after quiet_known_warnings (recipe.train)
    from coati_kto.trainer.kto import KTOTrainer

    steps = total_optimizer_steps(config, len(run.train_loader.batch_sampler))
    if run.layout.is_main and announce:
        # What model.attn_implementation auto became here (coati_kto.config.attention), then the rows' layout.
        cuda = torch.cuda.is_available()
        notes = (config.attention_note(), padding_free_note(config.data, config.model, cuda))
        for line in filter(None, notes):
            print(line, flush=True)
    groups_from = run.resume.state if run.resume is not None else None
    parts = build_components(config, run.plugin, steps, run.plan, groups_from)
    peak_flops, peak_source = resolve_peak_flops(config.train.peak_flops, config.plugin.precision)
    if run.layout.is_main and announce:
        print(peak_flops_line(peak_flops, peak_source), flush=True)
    output = config.training_output()
    manager = CheckpointManager(run.out_dir / CHECKPOINTS_DIR, parts.booster, run.layout, output.keep_last)
    trainer = KTOTrainer(
        parts.policy,
        parts.reference,
        parts.booster,
        parts.optimizer,
        run.plugin,
        parts.lr_scheduler,
        run.tokenizer,
        options=trainer_options(config, run.weights, peak_flops),
        layout=run.layout,
        plan=run.plan,
        checkpoint_manager=manager,
        run_config=config.model_dump(mode="json"),
        data_stats={**run.data.stats, "reference_weights": run.reference_weights},  # checkpointed
        stop_signals=stop,
    )
    return trainer, parts.frozen_fp32
