"""``coati-kto train CONFIG``: the whole run, top to bottom (every rank executes ``train``).

setup (process group, seed, data, tokenizer, plugin, models, optimizer, schedule, booster, loaders)
-> train (KTOTrainer.fit, resuming when train.resume says so) -> save (final checkpoint, HF export)
-> cleanup (writers close inside fit).

Ranks: rank 0 builds the prepared dataset if needed and writes every shared file (config.yaml, logs, the
export's files); tensor-parallel ranks of one data-parallel group get the same batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coati_kto.config.load import save_config
from coati_kto.config.resume import check_contents, check_resume
from coati_kto.config.schema import Config
from coati_kto.data.collator import KTOCollator
from coati_kto.data.loaders import build_loaders
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.tokenize import load_tokenizer, pad_id
from coati_kto.data.weights import WeightSettings, imbalance, resolve_kto_weights
from coati_kto.families import model_notes, vocabulary_size
from coati_kto.models.compile import maybe_compile
from coati_kto.models.hf import attention_implementation, freeze_vision_tower, load_causal_lm
from coati_kto.models.lora import AdapterFreeReference, enable_lora
from coati_kto.models.packing import padding_free_note, padding_free_rows
from coati_kto.parallel.distributed import (
    ParallelLayout,
    barrier,
    init_distributed,
    on_rank0,
    seed_everything,
)
from coati_kto.parallel.masters import gathered_masters
from coati_kto.parallel.optimizers import optimizer_for
from coati_kto.parallel.plan import ParallelPlan, check_tp_divides_world
from coati_kto.runtime.host_memory import keep_freed_memory
from coati_kto.runtime.preflight import announce_resume, check_training
from coati_kto.runtime.run_dir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    FINAL_DIR,
    TENSORBOARD_DIR,
    claim_output_dir,
    clear_previous_run,
    release_output_dir,
)
from coati_kto.runtime.signals import STOP, StopSignals
from coati_kto.runtime.watchdog import Heartbeat, new_heartbeat
from coati_kto.trainer.options import KTOOptions
from coati_kto.trainer.push import CheckpointUploads, checkpoint_uploads, push_final
from coati_kto.trainer.schedule import planned_steps, reschedule, schedule_notes, warmup_cosine_schedule
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
    config: Config, plugin: Any, total_steps: int, plan: ParallelPlan | None = None
) -> Components:
    """Models, optimizer, cosine schedule with warmup, boosted. Every rank calls, after ``plan.backend.build_plugin``.

    Both models load in fp32: the policy is boosted (ZeRO and the AMP optimizers keep fp32 masters; the plugin
    casts the working copy), the reference goes through the same plugin path without an optimizer
    (``ParallelBackend.build_reference``: same sharding, same cast, same fp32 rotary buffers), so at step 0 both
    give identical log-probs and the log-ratios start at exactly 0.
    """
    from colossalai.booster import Booster

    plan = plan or ParallelPlan.from_config(config)
    layout = ParallelLayout.from_plugin(plugin)
    policy = load_causal_lm(config.model.path, config.model, torch.float32)
    # A vision-language model's text passes never reach its tower (model_notes says so).
    fp32_export = config.output is not None and config.output.export_dtype == "fp32"
    frozen_fp32 = freeze_vision_tower(policy, keep_fp32=fp32_export and layout.is_main)
    if config.model.gradient_checkpointing:  # non-reentrant: shardformer's forward requires it
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    policy = maybe_compile(policy, config.model.compile)  # after checkpointing, before boosting
    booster = Booster(plugin=plugin)
    if config.model.lora is not None:  # before boosting: the plugins wrap the PeftModel
        policy = enable_lora(booster, policy, config.model.lora)
    # None with kto.reference cached: the batches carry its log-probs (coati_kto.trainer.reference_cache)
    reference = None
    if config.kto.reference == "online" and config.model.lora is None:
        reference = load_causal_lm(
            config.model.reference_path or config.model.path, config.model, torch.float32
        )
        reference = plan.backend.build_reference(plugin, maybe_compile(reference, config.model.compile))
    optimizer = optimizer_for(policy.parameters(), config.train, config.plugin.cpu_offload)
    lr_scheduler = warmup_cosine_schedule(
        optimizer, config.train.warmup_steps, max(1, total_steps), config.train.min_lr_ratio
    )
    # Every parameter, frozen ones too: ZeRO skips them; a ZeRO plugin finds adapters by their base layer.
    policy, optimizer, lr_scheduler = plan.backend.boost(booster, policy, optimizer, lr_scheduler)
    if config.model.lora is not None and config.kto.reference == "online":
        reference = AdapterFreeReference(policy)  # the base model: no second copy in memory
    return Components(plugin, booster, layout, policy, reference, optimizer, lr_scheduler, plan, frozen_fp32)


def total_optimizer_steps(
    config: Config, micro_batches_per_rank: int, resumed: tuple[int, int, int] | None = None
) -> int:
    """The run's optimizer steps under ``config`` (``trainer.schedule.planned_steps``)."""
    train = config.train
    return planned_steps(
        micro_batches_per_rank, train.accumulation_steps, train.max_epochs, train.max_steps, resumed
    )


def train(config: Config) -> Any:
    """Run KTO training as configured; returns the KTOTrainer (``history``: its last logged records).

    Every rank calls. User mistakes raise UserError subclasses (the CLI prints them on one line). SIGTERM,
    SIGINT or SIGUSR1 end the run after a checkpoint, raising TrainingStoppedError (coati_kto.runtime.signals).
    """
    check_training(config)  # before anything heavy: every problem at once
    # A run that continues a checkpoint says so first (unless its launcher did).
    announce_resume(config.train, config.training_output())
    # Installed for the rest of the process: a launcher may repeat the signal while this rank exits (torchrun
    # SIGTERMs the workers still running once one has exited), and that must not kill it mid-teardown.
    stop_signals = STOP.install()
    heartbeat = new_heartbeat(config.train.heartbeat_timeout)
    uploads = checkpoint_uploads(config)  # global rank 0 with output.push_to_hub.checkpoints, else None
    try:
        # torchrun's store exists before its workers start: watch from here, so a rank that dies before the
        # process group forms is caught too. Elsewhere rank 0 creates the store in init_distributed.
        if heartbeat is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            heartbeat.start()
        trainer = _train(config, stop_signals, heartbeat, uploads)
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if uploads is not None:  # before the lock goes: the uploads read from output.dir
            uploads.wait()
        release_output_dir(Path(config.training_output().dir))
    trainer.pushed = push_final(config)  # after the heartbeat stopped: no peer waits for an upload of hours
    return trainer


def _train(
    config: Config, stop_signals: StopSignals, heartbeat: Heartbeat | None, uploads: CheckpointUploads | None
) -> Any:
    """The recipe: setup, train, save, cleanup. Every rank runs every step."""
    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()  # before anything imports colossalai: it warns at import time
    run = _setup(config, heartbeat)
    trainer, frozen_fp32 = _setup_trainer(config, run, stop_signals)
    trainer.checkpoint_manager.on_complete = uploads
    _resume(config, run, trainer)
    # ---- train (checkpoints every output.save_interval steps and at the end; writers close inside fit)
    trainer.fit(
        run.train_loader,
        run.eval_loader,
        log_dir=str(run.out_dir / TENSORBOARD_DIR) if config.logging.tensorboard else None,
        use_wandb=config.logging.wandb,
    )
    _save_final(config, run, trainer, frozen_fp32)
    barrier()  # ---- cleanup: nobody leaves before the export is on disk
    return trainer


@dataclass
class _Run:
    """What setup produced for the rest of the recipe (every rank holds its own)."""

    out_dir: Path
    data: Any  # PreparedData, with reference log-probs when kto.reference is cached
    tokenizer: Any
    plan: ParallelPlan
    plugin: Any
    layout: ParallelLayout
    train_loader: Any
    eval_loader: Any
    weights: tuple[float, float]  # (lambda_D, lambda_U) for this data-parallel layout
    notes: list[str]  # one-line facts about choices made for the user: printed by rank 0, kept in the card


def _setup(config: Config, heartbeat: Heartbeat | None, training: bool = True) -> _Run:
    """Process group, seed, output directory, data, tokenizer, plugin and loaders (every rank). Not
    ``training`` (``coati-kto export``): output.dir is only read (no lock, no clearing, no config.yaml) and
    nothing is scored with the reference."""
    from coati_kto.data.prepared import load_prepared  # after quiet_known_warnings (see _train)
    from coati_kto.trainer.reference_cache import refuse_changed_contents, with_reference_logps

    init_distributed(timeout_s=config.train.dist_timeout)
    memory_note = keep_freed_memory() if training else None  # CPU runs only
    check_tp_divides_world(config.plugin.tp_size, dist.get_world_size())  # before the data and the model
    if heartbeat is not None and not heartbeat.is_alive():
        heartbeat.start()
    seed_everything(config.train.seed)
    out_dir = Path(config.training_output().dir)
    # Global rank 0 holds output.dir's lock from here to the end of the run: nothing is written there before.
    lock_note = on_rank0(lambda: claim_output_dir(out_dir), "lock output.dir") if training else None
    if training and config.training_output().overwrite:
        clear_previous_run(out_dir)  # rank 0 deletes, the others wait
    if training:  # a refused resume: before prepare rebuilds data.prepared_dir and the reference scores
        refuse_changed_contents(config, out_dir / CHECKPOINTS_DIR)
    weight_settings = WeightSettings(config.kto, config.train.micro_batch_size)
    data = load_prepared(PrepareSettings(config.data, config.model, config.train.seed), weight_settings)
    tokenizer = load_tokenizer(config.model)
    pad, pad_note = pad_id(tokenizer, vocabulary_size(config.model.path, config.model.reference_path))
    if training and config.kto.reference == "cached":  # once (all ranks) unless a matching cache exists
        data = with_reference_logps(config, data, pad)
    plan = ParallelPlan.from_config(config, dp_size=dist.get_world_size() // config.plugin.tp_size)
    plugin = plan.backend.build_plugin()
    layout = ParallelLayout.from_plugin(plugin)
    if layout.is_main and training:
        save_config(config, out_dir / CONFIG_FILE)
    collator = KTOCollator(pad, config.data.pad_to_multiple_of, padding_free_rows(config.data, config.model))
    train_loader, eval_loader = build_loaders(
        data, config.train, config.data.group_by_length, layout, collator
    )
    desirable, undesirable, report = resolve_kto_weights(
        weight_settings, data.stats, layout.dp_size, config.data.prepared_dir
    )
    # The run card shows the report of this layout, not prepare's one-replica view.
    data.stats["imbalance"] = imbalance(weight_settings, data.stats, layout.dp_size)
    attention_note = attention_implementation(config.model.path, config.model)[1]
    zero_note = _zero_note(config, plan) if training else None  # the export's own layout is not the run's
    epoch_note = train_loader.batch_sampler.stats.epoch_note() if training else None  # examples left out
    notes = [n for n in (epoch_note, lock_note, pad_note, attention_note, zero_note, memory_note) if n]
    notes += model_notes(config.model.path, config.kto.router_aux_loss_coef)
    if layout.is_main:
        print("\n".join([report, *notes]), flush=True)
    loaders, weights = (train_loader, eval_loader), (desirable, undesirable)
    return _Run(out_dir, data, tokenizer, plan, plugin, layout, *loaders, weights, notes)


def _setup_trainer(config: Config, run: _Run, stop: StopSignals) -> tuple[Any, dict[str, torch.Tensor]]:
    """Models, optimizer, schedule and the KTOTrainer (every rank); with it ``Components.frozen_fp32``."""
    from coati_kto.trainer.checkpoint import CheckpointManager  # after quiet_known_warnings (see _train)
    from coati_kto.trainer.kto import KTOTrainer
    from coati_kto.trainer.reference_cache import reference_weights_digest

    steps = total_optimizer_steps(config, len(run.train_loader.batch_sampler))
    if run.layout.is_main:
        # What model.attn_implementation auto became here (coati_kto.config.attention), then the rows' layout.
        cuda = torch.cuda.is_available()
        notes = (config.attention_note(), padding_free_note(config.data, config.model, cuda))
        for line in filter(None, notes):
            print(line, flush=True)
    parts = build_components(config, run.plugin, steps, run.plan)
    peak_flops, peak_source = resolve_peak_flops(config.train.peak_flops, config.plugin.precision)
    if run.layout.is_main:
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
        max_epochs=config.train.max_epochs,
        beta=config.kto.beta,
        desirable_weight=run.weights[0],
        undesirable_weight=run.weights[1],
        accumulation_steps=config.train.accumulation_steps,
        save_interval=output.save_interval,
        options=KTOOptions.from_config(config, peak_flops),
        layout=run.layout,
        plan=run.plan,
        checkpoint_manager=manager,
        run_config=config.model_dump(mode="json"),
        data_stats={**run.data.stats, "reference_weights": reference_weights_digest(config)},  # checkpointed
        stop_signals=stop,
    )
    return trainer, parts.frozen_fp32


def _zero_note(config: Config, plan: ParallelPlan) -> str | None:
    """One line when the ZeRO stage that runs is not the configured one (``parallel.plan.running_zero_stage``)."""
    if plan.zero_stage == config.plugin.zero_stage:
        return None
    return (
        f"plugin.zero_stage {config.plugin.zero_stage} runs as 0 on one data-parallel rank: nothing to shard, "
        "so no ZeRO buckets or reductions (the AMP optimizer keeps the fp32 masters; same updates)"
    )


def _resume(config: Config, run: _Run, trainer: Any) -> None:
    """Continue from train.resume's checkpoint, if any: changed settings are applied and named, or refused
    (coati_kto.config.resume); the schedule then spans the steps this run will take (the rest of the epoch in
    progress is re-planned on another layout or micro-batch size) and peaks at train.lr. Every rank calls."""
    checkpoint = trainer.checkpoint_manager.resolve_everywhere(config.train.resume)  # rank 0 decides
    state = trainer.checkpoint_manager.saved_state(checkpoint) if checkpoint is not None else {}
    saved = state.get("config")
    line = check_resume(saved, config.model_dump(mode="json"), checkpoint.name) if saved is not None else None
    if checkpoint is not None:
        check_contents(state, trainer.data_stats, checkpoint.name)
    resumed = None
    if checkpoint is not None:
        trainer.resume(checkpoint)
        resumed = (trainer.global_step, *trainer.position.left_in_epoch(run.train_loader))
    steps = total_optimizer_steps(config, len(run.train_loader.batch_sampler), resumed)
    if checkpoint is not None:
        train = config.train
        reschedule(trainer.lr_scheduler, train.lr, train.warmup_steps, steps, train.min_lr_ratio)
    if line is not None:
        run.notes.append(line)
    if run.layout.is_main:
        said = [f"resumed from {checkpoint} at optimizer step {trainer.global_step}"] if checkpoint else []
        said += [line] if line is not None else []
        for text in said + schedule_notes(config.train, steps):
            print(text, flush=True)


def _save_final(
    config: Config,
    run: _Run,
    trainer: Any,
    frozen_fp32: dict[str, torch.Tensor],
    final_dir: Path | None = None,
    world_size: int | None = None,
) -> None:
    """The trained model in Hugging Face format under ``final_dir`` (output.dir/final), with its model card
    (every rank). ``coati-kto export`` names its directory and the processes the checkpoint was trained on."""
    from coati_kto.models.lora import export_lora  # after quiet_known_warnings (see _train)
    from coati_kto.trainer.model_card import write_model_card

    if final_dir is None and not config.training_output().save_final:
        return
    what = "final model" if final_dir is None else "exported model"
    final_dir = final_dir or run.out_dir / FINAL_DIR
    if config.model.lora is not None:  # final/adapter (peft) and, with output.merge_lora, final/merged
        merge = config.training_output().merge_lora
        final = export_lora(trainer.policy, run.tokenizer, final_dir, run.layout.is_main, merge)
    else:
        masters = None
        if config.training_output().export_dtype == "fp32":
            masters = gathered_masters(trainer.policy, trainer.optimizer)  # a collective: every rank
            masters.update(frozen_fp32)
        final = trainer.checkpoint_manager.export_hf(trainer.policy, run.tokenizer, final_dir, masters)
        run.notes.append(_export_note(config, f"{final_dir.name}/"))
    if run.layout.is_main:
        history, steps, world = trainer.history, trainer.global_step, world_size or run.layout.world_size
        write_model_card(final, config, run.data.stats, history, steps, run.weights, world, run.notes)
        print(f"{what}: {final}", flush=True)
        if config.model.lora is None:
            print(run.notes[-1], flush=True)  # what its weights are


def _export_note(config: Config, where: str = "final/") -> str:
    """What the export's weights are (``where``: final/, or step-N/ for coati-kto export), in one line (the card
    repeats it)."""
    precision = config.plugin.precision
    if config.training_output().export_dtype == "fp32":
        return f"{where} holds the optimizer's fp32 master weights (trained in {precision}; output.export_dtype fp32)"
    if precision == "fp32":
        return f"{where} holds the fp32 weights the run trained"
    return (
        f"{where} holds the {precision} weights the run trained (its base was loaded in fp32 and cast); "
        "output.export_dtype=fp32 writes the fp32 master weights instead"
    )
