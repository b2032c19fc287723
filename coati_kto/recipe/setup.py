"""What a run's commands set up alike, before any model: a ``Run`` (every rank builds its own).

- ``load_run_data``: the prepared data (built by rank 0 when missing), the tokenizer and the pad token: what
  ``coati-kto precompute`` needs, and the data part of both builders below.
- ``setup_training``: the process group, the seed, output.dir claimed (its lock; cleared with output.overwrite), the
  reference weights' digest, the checkpoint train.resume continues (``Run.resume``: read once here, for the
  optimizer's grouping and the resume) and a refused resume caught before the data is rebuilt, the reference's
  log-probs with ``kto.reference: cached``
  (``coati_kto.reference``, from ``reference_settings``), the plan and plugin, config.yaml, the loaders and the
  KTO weights of this data-parallel layout.
- ``setup_export``: the same run read back for ``coati-kto export``: output.dir is only read (no lock, no
  clearing, no config.yaml) and nothing is scored with the reference.

Both print the weights' report and the one-line notes about choices made for the user on the main rank; the
notes travel on in ``Run.notes`` to the model card.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from coati_kto.config.load import save_config
from coati_kto.config.pipeline import check_pipeline_divides_world, pipeline_note, stage_note
from coati_kto.config.resume import check_contents
from coati_kto.config.schema import Config, PluginSection
from coati_kto.config.sequence import sequence_note
from coati_kto.data.collator import KTOCollator
from coati_kto.data.image_store import load_processor
from coati_kto.data.loaders import build_loaders
from coati_kto.data.settings import PrepareSettings
from coati_kto.data.store import fingerprint
from coati_kto.data.tokenize import load_tokenizer
from coati_kto.data.train_data import train_data_digest, train_data_parts
from coati_kto.data.vocabulary import model_pad_id
from coati_kto.data.weights import WeightSettings, imbalance, resolve_kto_weights
from coati_kto.errors import ConfigError
from coati_kto.families import model_notes
from coati_kto.models.hf import attention_implementation
from coati_kto.models.packing import padding_free_rows
from coati_kto.parallel.distributed import ParallelLayout, init_distributed, on_rank0, seed_everything
from coati_kto.parallel.load_check import refuse_a_load_no_node_holds
from coati_kto.parallel.plan import ParallelPlan, check_tp_divides_world
from coati_kto.recipe.images import image_collator
from coati_kto.recipe.plan import predicted_peak_line
from coati_kto.reference.settings import ReferenceSettings
from coati_kto.reference.weights import reference_weights_digest
from coati_kto.runtime.host_memory import keep_freed_memory
from coati_kto.runtime.lineage import resume_choice
from coati_kto.runtime.resume_checks import overwrite_refusal
from coati_kto.runtime.run_dir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    claim_output_dir,
    clear_previous_run,
    saved_trainer_state,
)
from coati_kto.runtime.watchdog import Heartbeat


@dataclass
class RunData:
    """The prepared data with the tokenizer that reads it (``load_run_data``)."""

    data: Any  # PreparedData; with reference log-probs once kto.reference cached scored it
    tokenizer: Any
    pad: int  # the pad token id the collator fills with
    pad_note: str | None  # one line when the pad token was chosen here (data.vocabulary.pad_id)
    images: dict[str, Any]  # the collator's image keywords (coati_kto.recipe.images); empty without images
    image_note: str | None  # one line when image records turn a pass off


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues, as global rank 0 chose it (damage-checked) once output.dir is locked, and
    its trainer state (rank 0's file, the same on every rank; None in a checkpoint saved without one)."""

    checkpoint: Path
    state: dict | None


@dataclass
class Run:
    """What setup produced for the rest of a recipe (every rank holds its own)."""

    out_dir: Path
    data: Any  # PreparedData, with reference log-probs when kto.reference is cached (training)
    tokenizer: Any
    plan: ParallelPlan
    plugin: Any
    layout: ParallelLayout
    train_loader: Any
    eval_loader: Any
    weights: tuple[float, float]  # (lambda_D, lambda_U) for this data-parallel layout
    weights_report: str  # the one-line report of those weights (data.weights.resolve_kto_weights)
    notes: list[str]  # one-line facts about choices made for the user: printed by rank 0, kept in the card
    resume: ResumePoint | None = None  # train.resume's checkpoint (an export's: the one it exports)
    reference_weights: str | None = None  # reference_weights_digest's, checkpointed (None for an export)


def prepare_settings(config: Config) -> PrepareSettings:
    """What a run's prepared data is built from. Image records are read for a vision-language model, as
    ``coati-kto prepare`` reads them (coati_kto.data.image_store)."""
    return PrepareSettings(config.data, config.model, config.train.seed, images=True)


def load_run_data(config: Config) -> RunData:
    """The prepared data (rank 0 prepares it when data.prepared_dir holds none; the others wait), the tokenizer
    and the pad token. Every rank calls, in a process group."""
    from coati_kto.data.prepared import load_prepared  # after quiet_known_warnings (coati_kto.recipe.train)

    data = load_prepared(prepare_settings(config), WeightSettings(config.kto, config.train.micro_batch_size))
    images, image_note = image_collator(config, data)  # a setting images cannot run with: refused here
    tokenizer = load_tokenizer(config.model)
    pad, pad_note = model_pad_id(tokenizer, config.model)
    return RunData(data, tokenizer, pad, pad_note, images, image_note)


def setup_training(config: Config, heartbeat: Heartbeat | None) -> Run:
    """The training run's setup (every rank): see the module's docstring. Starts ``heartbeat`` once the process
    group exists, unless its launcher's store let it start earlier."""
    from coati_kto.reference.cache import with_reference_logps

    _start_processes(config)
    memory_note = keep_freed_memory()  # CPU runs only
    if heartbeat is not None and not heartbeat.is_alive():
        heartbeat.start()
    out_dir = Path(config.training_output().dir)
    refusal = overwrite_refusal(config.train, config.training_output())  # preflight's too: nothing deleted
    if refusal is not None:  # the config alone decides: every rank raises it
        raise ConfigError(refusal)
    # Global rank 0 holds output.dir's lock from here to the end of the run: nothing is written there before.
    lock_note = on_rank0(lambda: claim_output_dir(out_dir), "lock output.dir")
    if config.training_output().overwrite:
        clear_previous_run(out_dir)  # rank 0 deletes, the others wait
    # Read once, here: the checkpoints record it and a resume compares it with the checkpoint's.
    reference = reference_weights_digest(config.model, config.kto.reference)
    # A refused resume: before prepare rebuilds data.prepared_dir and the reference scores.
    resume = _resume_point(config, out_dir / CHECKPOINTS_DIR, reference)
    refuse_a_load_no_node_holds(config)  # before the cached reference or the models are read
    run_data = load_run_data(config)
    if config.kto.reference == "cached":  # once (all ranks) unless a matching cache exists
        settings = reference_settings(config)
        run_data.data = with_reference_logps(settings, run_data.data, run_data.pad, run_data.images)
    run = _build_run(config, out_dir, run_data)
    run.resume, run.reference_weights = resume, reference
    if run.layout.is_main:
        save_config(config, out_dir / CONFIG_FILE)
    epoch_note = run.train_loader.batch_sampler.stats.epoch_note()  # examples left out
    attention_note = attention_implementation(config.model.path, config.model)[1]
    layout_notes = (
        zero_note(config.plugin, run.plan),
        sequence_note(config),
        stage_note(config),
        pipeline_note(config),
    )
    notes = (epoch_note, lock_note, run_data.pad_note, run_data.image_note, attention_note, *layout_notes)
    notes += (memory_note,)
    _announce(config, run, notes)
    if run.layout.is_main:  # the plan's peak for this layout (coati_kto.recipe.plan), not kept in the card
        print(predicted_peak_line(config, run.layout.world_size, device_memory()), flush=True)
    return run


def device_memory() -> int | None:
    """Bytes of this rank's GPU; None on the CPU (no device-memory check there: the ranks share host memory)."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def setup_export(config: Config, scratch: Callable[[], Path], trained_dp_size: int | None = None) -> Run:
    """The run of ``config`` read back for ``coati-kto export`` (every rank): output.dir is only read and nothing
    is scored. The export's own layout is not the run's: no ZeRO note, and the KTO weights are those of the
    run's ``trained_dp_size`` data-parallel ranks (auto_weights depend on them), not of this launch. Where
    data.prepared_dir does not hold the run's data, it is prepared in ``scratch()``: a directory global rank 0
    makes once the process group exists (the caller removes it; the others read it where rank 0 says)."""
    from coati_kto.data.prepared import elsewhere

    _start_processes(config)
    refuse_a_load_no_node_holds(config)  # the policy and its masters load whole on every rank here too
    where = prepare_settings(config)
    moved, note = on_rank0(
        lambda: elsewhere(where, scratch(), "export", missing_too=True), "check data.prepared_dir"
    )
    if note and dist.get_rank() == 0:
        print(note, flush=True)
    run_data = load_run_data(config.model_copy(update={"data": moved.data}))
    run = _build_run(config, Path(config.training_output().dir), run_data, trained_dp_size)
    attention_note = attention_implementation(config.model.path, config.model)[1]
    _announce(config, run, (run_data.pad_note, attention_note), show=False)
    return run


def reference_settings(config: Config) -> ReferenceSettings:
    """What the reference cache reads of ``config``: the model, data and kto sections and the run's dtype."""
    return ReferenceSettings(config.model, config.data, config.kto, ParallelPlan.from_config(config).dtype)


def zero_note(plugin: PluginSection, plan: ParallelPlan) -> str | None:
    """One line when the ZeRO stage that runs is not the configured one (``parallel.plan.running_zero_stage``)."""
    if plan.zero_stage == plugin.zero_stage:
        return None
    return (
        f"plugin.zero_stage {plugin.zero_stage} runs as 0 on one data-parallel rank: nothing to shard, "
        "so no ZeRO buckets or reductions (the AMP optimizer keeps the fp32 masters; same updates)"
    )


def _start_processes(config: Config) -> None:
    """The process group (every rank), the tensor-, sequence- and pipeline-parallel sizes checked against it before
    the data and the model load, and the run's seed."""
    init_distributed(config.train.dist_timeout, config.train.file_wait_timeout)
    check_pipeline_divides_world(config.plugin, dist.get_world_size())
    check_tp_divides_world(config.plugin.tp_size, dist.get_world_size(), config.plugin.sp_size)
    seed_everything(config.train.seed)


def _resume_point(config: Config, checkpoints: Path, reference: str | None) -> ResumePoint | None:
    """The checkpoint train.resume continues (under ``checkpoints``; None for a fresh run), refused (a
    ConfigError) where its training data (files edited in place, another tokenizer) or its reference weights
    (``reference``: this run's digest) changed since (``check_contents``): before data.prepared_dir is rebuilt,
    deleting the reference cache the checkpoint's run needs, and the new data scored. A damaged checkpoint
    (``lineage.resume_choice``) is refused here too. Global rank 0 decides and reads; every rank calls and gets
    its answer."""
    resume = config.train.resume
    checkpoint = on_rank0(lambda: resume_choice(checkpoints, resume)[0], "resolve the checkpoint")
    if checkpoint is None:
        return None
    state = on_rank0(lambda: saved_state_or_none(checkpoint), "read the checkpoint's trainer state")
    if state is None:  # decided on rank 0: every rank takes the same waits below, or none
        return ResumePoint(checkpoint, None)
    inputs = PrepareSettings(config.data, config.model, config.train.seed, images=True)
    fp = on_rank0(
        lambda: fingerprint(inputs, load_tokenizer(inputs.model), load_processor(inputs)), "hash the data"
    )
    contents = {"train_data": train_data_digest(fp), "train_data_parts": train_data_parts(fp)}
    check_contents(state, {**contents, "reference_weights": reference}, checkpoint.name)
    return ResumePoint(checkpoint, state)


def _build_run(config: Config, out_dir: Path, run_data: RunData, weights_dp_size: int | None = None) -> Run:
    """The plan and plugin for this world, the loaders by data-parallel rank and the KTO weights of this layout
    (or of ``weights_dp_size`` data-parallel ranks: an export's run)."""
    # The plan's dp_size is the gradient group's (ZeRO's shards, DDP's replicas): dp x sp under all_to_all; a
    # pipeline stage's parameters are its own, so pp divides it out as tp does.
    model_split = config.plugin.tp_size * getattr(config.plugin, "pp_size", 1)
    plan = ParallelPlan.from_config(config, dp_size=dist.get_world_size() // model_split)
    plugin = plan.backend.build_plugin()
    layout = ParallelLayout.from_plugin(plugin)
    data = run_data.data
    # Pipeline stages take the padded rows: the schedule splits every batch tensor along its rows.
    rows = padding_free_rows(config.data, config.model) if plan.pp_size == 1 else None
    # Sequence-parallel peers read the same micro-batch (the loaders go by dp rank) and keep their own slice.
    sequence = (layout.sp_size, layout.sp_rank) if layout.sp_size > 1 else None
    collator = KTOCollator(run_data.pad, config.data.pad_to_multiple_of, rows, sequence, **run_data.images)
    train_loader, eval_loader = build_loaders(
        data, config.train, config.data.group_by_length, layout, collator
    )
    weight_settings = WeightSettings(config.kto, config.train.micro_batch_size)
    replicas = weights_dp_size or layout.dp_size
    desirable, undesirable, report = resolve_kto_weights(
        weight_settings, data.stats, replicas, config.data.prepared_dir
    )
    # The run card shows the report of this layout, not prepare's one-replica view.
    data.stats["imbalance"] = imbalance(weight_settings, data.stats, replicas)
    loaders, weights = (train_loader, eval_loader), (desirable, undesirable)
    return Run(out_dir, data, run_data.tokenizer, plan, plugin, layout, *loaders, weights, report, [])


def _announce(config: Config, run: Run, notes: tuple[str | None, ...], show: bool = True) -> None:
    """``run.notes``: the given notes that say something, then the model's own; the main rank prints them after
    the weights' report (``show``: not for an export, which trains nothing)."""
    run.notes = [n for n in notes if n] + model_notes(
        config.model.path, config.kto.router_aux_loss_coef, config.model.train_vision
    )
    if run.layout.is_main and show:
        print("\n".join([run.weights_report, *run.notes]), flush=True)


def saved_state_or_none(checkpoint: Path) -> dict | None:
    """``checkpoint``'s trainer state (rank 0's file), or None where it has none (written before it kept one)."""
    try:
        return saved_trainer_state(checkpoint)["trainer_state"]
    except FileNotFoundError:
        return None
