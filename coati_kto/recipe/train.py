"""``coati-kto train CONFIG``: the whole run, top to bottom (every rank executes ``train``).

setup (process group, seed, data, tokenizer, plugin, loaders: ``setup_training``; models, optimizer, schedule,
booster and the trainer: ``build_trainer``) -> train (KTOTrainer.fit, resuming when train.resume says so) -> save
(the final model and its card: ``save_final``) -> cleanup (writers close inside fit; the lock on output.dir goes,
then the upload to the Hub).

Ranks: rank 0 builds the prepared dataset if needed and writes every shared file (config.yaml, logs, the
export's files); tensor-parallel ranks of one data-parallel group get the same batches.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from coati_kto.config.output import OutputSection
from coati_kto.config.resume import check_contents, check_resume, optimizer_groups_problem
from coati_kto.config.schema import Config
from coati_kto.data.prepared_lock import release as release_prepared
from coati_kto.errors import ConfigError
from coati_kto.outputs.push import CheckpointUploads, checkpoint_uploads, push_final, pushed_at_end
from coati_kto.parallel.optimizers import set_weight_decay
from coati_kto.parallel.store_waits import wait_for_all
from coati_kto.recipe.components import build_trainer, total_optimizer_steps
from coati_kto.recipe.save import save_final
from coati_kto.recipe.setup import Run, setup_training
from coati_kto.runtime.preflight import announce_resume, check_training
from coati_kto.runtime.run_dir import TENSORBOARD_DIR, release_output_dir
from coati_kto.runtime.signals import STOP, StopSignals, TrainingStoppedError
from coati_kto.runtime.startup import release_collection
from coati_kto.runtime.watchdog import Heartbeat, new_heartbeat
from coati_kto.trainer.schedule import accumulation_note, reschedule, schedule_notes


def train(config: Config) -> Any:
    """Run KTO training as configured; returns the KTOTrainer (``history``: its last logged records).

    Every rank calls. User mistakes raise UserError subclasses (the CLI prints them on one line). SIGTERM,
    SIGINT or SIGUSR1 end the run after a checkpoint, raising TrainingStoppedError (coati_kto.runtime.signals).
    """
    try:
        check_training(config)  # before anything heavy: every problem at once
    except ConfigError as err:
        # What it reads can differ between nodes (a model directory on node-local disk, an installed package):
        # the first rank of each node says its own, not global rank 0 alone; the other ranks of a node stay quiet.
        err.same_on_every_rank = os.environ.get("LOCAL_RANK", "0") != "0"
        raise
    output = config.training_output()
    # A run that continues a checkpoint says so first (unless its launcher did).
    announce_resume(config.train, output)
    # Installed for the rest of the process: a launcher may repeat the signal while this rank exits (torchrun
    # SIGTERMs the workers still running once one has exited), and that must not kill it mid-teardown.
    stop_signals = STOP.install()
    heartbeat = new_heartbeat(config.train.heartbeat_timeout, start_timeout=config.train.dist_timeout)
    uploads = checkpoint_uploads(output)  # global rank 0 with output.push_to_hub.checkpoints, else None
    try:
        try:
            # torchrun's store exists before its workers start: watch from here, so a rank that dies before the
            # process group forms is caught too. Elsewhere rank 0 creates the store in init_distributed.
            if heartbeat is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                heartbeat.start()
            trainer = _train(config, stop_signals, heartbeat, uploads)
        except TrainingStoppedError:
            wait_for_uploads_after_stop(output, uploads)
            raise
        except BaseException:  # the peers exit now: waiting for an upload would get this rank killed (exit 1)
            if uploads is not None:
                uploads.abandon()
            raise
        finally:
            if heartbeat is not None:
                heartbeat.stop()
            checkpoints_up = uploads.wait() if uploads is not None else True
        # after the heartbeat stopped: no peer waits for an upload of hours
        trainer.pushed = pushed_at_end(push_final(output), checkpoints_up)
    finally:  # after every upload: they read from output.dir, which a run started here meanwhile would clear
        release_output_dir(Path(output.dir))
        release_prepared(Path(config.data.prepared_dir))  # global rank 0's: another build may replace it now
    return trainer


def wait_for_uploads_after_stop(output: OutputSection, uploads: CheckpointUploads | None) -> None:
    """After a stop's checkpoint, with output.push_to_hub.checkpoints: every rank waits (in the store, up to
    train.file_wait_timeout) until global rank 0's uploads are done, then all exit 75 together. torchrun ends
    the other workers once one exits non-zero and SIGKILLs one that outlives that by 30 s: rank 0, still
    uploading the stop's checkpoint while its peers had exited 75, was killed and the job exited 1 (no
    requeue). Every rank calls; ``uploads`` is rank 0's (None elsewhere)."""
    push = output.push_to_hub
    if push is None or not push.checkpoints:
        return
    if uploads is not None:
        uploads.wait()
    wait_for_all("global rank 0 to finish its checkpoint uploads")


def _train(
    config: Config, stop_signals: StopSignals, heartbeat: Heartbeat | None, uploads: CheckpointUploads | None
) -> Any:
    """The recipe: setup, train, save, cleanup. Every rank runs every step."""
    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()  # before anything imports colossalai: it warns at import time
    import colossalai.booster  # noqa: F401  (the plugins' imports, seconds of them: made while the collector is held)

    release_collection()  # the imports are done: their objects frozen, the collector on before setup builds anything
    # ---- setup
    run = setup_training(config, heartbeat)
    trainer, frozen_fp32 = build_trainer(config, run, stop_signals)
    trainer.checkpoint_manager.on_complete = uploads
    _resume(config, run, trainer)
    # ---- train (checkpoints every output.save_interval steps and at the end; writers close inside fit)
    trainer.fit(
        run.train_loader,
        run.eval_loader,
        log_dir=str(run.out_dir / TENSORBOARD_DIR) if config.logging.tensorboard else None,
        use_wandb=config.logging.wandb,
    )
    # ---- save
    save_final(config, run, trainer, frozen_fp32)
    wait_for_all("global rank 0 to write final/")  # ---- cleanup: nobody leaves before the export is on disk
    return trainer


def _resume(config: Config, run: Run, trainer: Any) -> None:
    """Continue from train.resume's checkpoint, if any: changed settings are applied and named, or refused
    (coati_kto.config.resume); the schedule then spans the steps this run will take (the rest of the epoch in
    progress is re-planned on another layout or micro-batch size) and peaks at train.lr. Every rank calls.
    ``run.resume``: the checkpoint and trainer state setup read on global rank 0, with output.dir locked (no save
    lands there since)."""
    checkpoint = run.resume.checkpoint if run.resume is not None else None
    state = (run.resume.state if run.resume is not None else None) or {}
    saved = state.get("config")
    current = config.model_dump(mode="json")
    cwd = state.get("config_cwd")
    line = check_resume(saved, current, checkpoint.name, saved_cwd=cwd) if saved is not None else None
    groups = optimizer_groups_problem(state, current, checkpoint.name) if saved is not None else None
    if groups is not None:
        raise ConfigError(groups)
    if checkpoint is not None:
        check_contents(state, trainer.data_stats, checkpoint.name)
    resumed = None
    if checkpoint is not None:
        trainer.resume(checkpoint)
        resumed = (trainer.global_step, *trainer.position.left_in_epoch(run.train_loader))
    steps = total_optimizer_steps(config, len(run.train_loader.batch_sampler), resumed)
    if checkpoint is not None:
        train = config.train
        reschedule(
            trainer.lr_scheduler, train.lr, train.warmup_steps, steps, train.min_lr_ratio, train.lr_schedule
        )
        set_weight_decay(trainer.optimizer, train.weight_decay)  # the checkpoint's groups carry the old one
    if line is not None:
        run.notes.append(line)
    micro_batches, dp_size = len(run.train_loader.batch_sampler), run.layout.dp_size
    notes = schedule_notes(config.train, steps, micro_batches, dp_size)
    if (accumulation := accumulation_note(config.train, micro_batches, dp_size)) is not None:
        run.notes.append(accumulation)  # the model card's too
    if run.layout.is_main:
        said = [f"resumed from {checkpoint} at optimizer step {trainer.global_step}"] if checkpoint else []
        said += [line] if line is not None else []
        for text in said + notes:
            print(text, flush=True)
