"""``coati-kto export CONFIG [--checkpoint auto|DIR] [--out DIR]``: a run's checkpoint as the Hugging Face model
(and model card) that training writes at its end, to evaluate a run part-way or to recover an export that was
lost. Every rank calls ``export_checkpoint``.

The recipe: check the checkpoint and the target (``coati_kto.outputs.export``), set up as the run did
(``setup_export``: data, tokenizer, plugin; ``build_trainer``: policy and optimizer, no reference model), load the
checkpoint as a resume does and write the export as the end of training does (``save_final``): the same files,
the same dtype rules (output.export_dtype), LoRA adapters and merged weights as output.merge_lora says. For an
fp32 export of a bf16 run, run it on the layout the checkpoint was saved on (``--nproc-per-node N``): the fp32
masters are per rank, and on another layout they would be rebuilt from the working weights.

output.dir is only read: a run still training there is not disturbed (its lock is not taken), and nothing is
written under output.dir except the export itself (default ``output.dir/exports/step-N``).

``--push`` uploads to output.push_to_hub: ``final/`` as it is when the run finished (no checkpoint or --out
named: the retry of a failed upload at the end of training; nothing is loaded), else the export just written.

A stop signal (SIGTERM, Ctrl-C) ends it at once (the CLI gives it ``STOP.quit_on_stop``): its scratch data and a
partial export are removed on the way out, and global rank 0 says in one line whether the export is complete or
nothing was written; exit 128 + the signal.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from coati_kto.config.resume import check_resume, with_legacy
from coati_kto.config.schema import Config
from coati_kto.data.prepared_lock import release
from coati_kto.errors import ConfigError, UserError
from coati_kto.outputs.export import check_masters_layout, claim_target, export_target, release_target
from coati_kto.outputs.model_card import CARD
from coati_kto.parallel.distributed import on_rank0
from coati_kto.parallel.stages import least_microbatches
from coati_kto.recipe.components import build_trainer
from coati_kto.recipe.save import save_final
from coati_kto.recipe.setup import ResumePoint, saved_state_or_none, setup_export
from coati_kto.runtime.durable import DATA, own_dir
from coati_kto.runtime.run_dir import CHECKPOINTS_DIR, saved_trainer_state
from coati_kto.runtime.signals import STOP, CommandStoppedError


def export_checkpoint(config: Config, checkpoint: str = "auto", out: str | None = None) -> Path:
    """Write ``checkpoint`` (``auto``: the latest complete one under output.dir/checkpoints; or a step-N
    directory) as a Hugging Face model into ``out`` (default output.dir/exports/step-N), which must not exist
    yet. Returns the export's path. Every rank calls; user mistakes raise UserError (one line)."""
    from coati_kto.parallel.upstream.noise import quiet_known_warnings

    quiet_known_warnings()  # before anything imports colossalai: it warns at import time
    root = Path(config.training_output().dir) / CHECKPOINTS_DIR
    # A missing checkpoint, an existing target, fp32 masters of another layout: said before anything heavy.
    first, first_target = export_target(root, checkpoint, out, say=True)
    check_masters_layout(config.training_output(), config.model.lora, config.plugin, first)
    config = run_config(config, first)
    writer = os.environ.get("RANK", "0") == "0"  # global rank 0 writes the export
    STOP.leaves(_left(first_target))
    scratch = _Scratch(first_target)

    def export() -> Path:
        claimed = False
        try:
            # Another export to this target is refused from here to the end (a second one deleted ours).
            if writer:
                with STOP.held():  # taken and recorded at once: a stop between the two would leave it held
                    claim_target(first_target, first)
                    claimed = True
            # Global rank 0 pins what it chose before anything slow: a run still training in output.dir prunes old
            # checkpoints (output.keep_last), which took this one's files from under the load (a raw
            # FileNotFoundError, or masters rebuilt from bf16 where one went mid-load). Every rank loads its copy.
            pinned = scratch.pin(first) if writer else first
            return _export(config, first, (pinned, first_target), scratch)
        finally:  # inside stoppable: a stop ends the process once this has run
            # the build global rank 0 used, when it was there (prepared_lock): another may replace it from now
            release(Path(config.data.prepared_dir))
            scratch.remove()
            if claimed:
                release_target(first_target)

    # A stop signal (coati-kto export runs with STOP.quit_on_stop) ends it here, after the scratch is removed.
    return STOP.stoppable(export)


def _left(target: Path) -> Callable[[], str]:
    """What a stop leaves, for its line: asked when it ends the process (the export is complete once its card is
    written, the last file)."""

    def said() -> str:
        if (target / CARD).is_file():
            return f"the export {target} is complete"
        return f"nothing written to {target}; the checkpoint and output.dir are as they were"

    return said


class _Scratch:
    """Where global rank 0 prepares the run's data when data.prepared_dir holds another build: a directory of its
    own beside the export (``.NAME.coati-kto-data-XXXXXXXX``), made when asked, removed at the end. A fixed name
    (``NAME.prepared``) was deleted at the end even when it was a folder of the user's."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.made: Path | None = None

    def _dir(self) -> Path:
        if self.made is None:
            with STOP.held():  # made and named at once: a stop between the two would leave it behind
                try:
                    self.made = own_dir(self.target, DATA)
                except OSError as err:  # root passes access() where it cannot write: /proc, some FUSE mounts
                    raise UserError(
                        f"coati-kto export: cannot write {self.target} ({err.strerror or err})"
                    ) from None
        return self.made

    def __call__(self) -> Path:
        return self._dir() / "prepared"

    def pin(self, checkpoint: Path) -> Path:
        """``checkpoint``'s files hard-linked here (no bytes copied; a prune of the original leaves them), or
        ``checkpoint`` itself where the filesystem takes no hard links (gcsfuse, s3fs: the race stays there)."""
        pinned = self._dir() / checkpoint.name
        try:
            shutil.copytree(checkpoint, pinned, copy_function=os.link)
        except OSError:
            shutil.rmtree(pinned, ignore_errors=True)
            return checkpoint
        return pinned

    def remove(self) -> None:
        if self.made is not None:  # global rank 0's: the others never make one
            release(self())  # the build it read there (prepared_lock)
            shutil.rmtree(self.made, ignore_errors=True)


def _export(config: Config, first: Path, chosen: tuple[Path, Path], scratch: _Scratch) -> Path:
    """Export ``chosen``, (the pinned checkpoint, the target) as this rank has them: global rank 0's are used."""
    # The optimizer is built (it holds the fp32 masters) but the reference model is not: nothing is scored.
    unscored = config.model_copy(update={"kto": config.kto.model_copy(update={"reference": "cached"})})
    run = setup_export(config, scratch, json.loads((first / "meta.json").read_text()).get("dp_size"))
    # STOP, not STOP.install(): nothing steps here, and train's handlers would turn a stop into a flag nobody reads.
    # its optimizer grouped as the checkpoint's (at weight decay 0 the config cannot tell): it loads its state
    run.resume = ResumePoint(chosen[0], saved_state_or_none(chosen[0]))
    trainer, frozen_fp32 = build_trainer(unscored, run, STOP, announce=False)
    # Rank 0's pinned copy and target: another rank may have chosen another save (auto, a run saving meanwhile).
    path, target = on_rank0(lambda: chosen, "pin the checkpoint")
    STOP.leaves(_left(target))
    state = trainer.checkpoint_manager.saved_state(path)
    # refuses another model, tokenizer, LoRA or data than the checkpoint's
    if (saved := state.get("config")) is not None:
        current = config.model_dump(mode="json")
        check_resume(saved, current, path.name, export=True, saved_cwd=state.get("config_cwd"))
    trainer.resume(path, export=True)  # leaves the run's `latest` pointer as it is
    trained_on = json.loads((path / "meta.json").read_text()).get("world_size")  # the card's process count
    try:
        save_final(config, run, trainer, frozen_fp32, final_dir=target, world_size=trained_on)
    except CommandStoppedError:
        # Renamed into place but stopped before its card: this export's own (the target did not exist), not whole.
        if run.layout.is_main and not (target / CARD).is_file():
            shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def run_config(config: Config, path: Path) -> Config:
    """The config the checkpoint at ``path`` was trained with (its output section and its parallel layout from
    ``config``): what the export and its card describe. Another model, tokenizer, LoRA or data is refused
    (check_resume); a changed training setting (kto.beta, train.lr...) would otherwise be written into the card
    as the run's."""
    state = saved_trainer_state(path)["trainer_state"]
    if state.get("config") is None:
        return config
    saved = with_legacy(state["config"])  # an older run's optimizer groups: what its checkpoint holds
    check_resume(
        saved, config.model_dump(mode="json"), path.name, export=True, saved_cwd=state.get("config_cwd")
    )
    current = config.model_dump(mode="json")
    # The export's own layout is this launch's, not the run's: its tensor-, sequence- and pipeline-parallel sizes,
    # and the ZeRO stage (ColossalAI takes 0 or 1 under pp: a run trained at 2 exports at pp 2 with 1).
    layout = ("tp_size", "sp_size", "sp_mode", "pp_size", "pp_style", "num_model_chunks", "zero_stage")
    plugin = {**saved["plugin"], **{k: current["plugin"][k] for k in layout if k in current["plugin"]}}
    data = {**saved["data"], **{k: current["data"][k] for k in ("prepared_dir", "num_proc")}}  # may move
    return _validated({**saved, "output": current["output"], "plugin": plugin, "data": data}, path)


def _validated(payload: dict, path: Path) -> Config:
    """``payload`` (the run's config on the export's layout) validated. The schedule's rule that a training step
    fills the pipeline stages (train.accumulation_steps >= pp_size) is not the export's: it trains nothing, so the
    check runs with the fewest micro-batches the stages take and the config keeps the run's own (the card's)."""
    plugin, train = payload["plugin"], payload["train"]
    stages, style = int(plugin.get("pp_size", 1)), plugin.get("pp_style", "1f1b")
    schedulable = least_microbatches(stages, style, int(train["accumulation_steps"]))
    try:
        checked = Config.model_validate({**payload, "train": {**train, "accumulation_steps": schedulable}})
    except ValidationError as err:  # a run trained before a setting that did nothing there was refused
        problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())
        raise ConfigError(
            f"checkpoint {path.name}: the config it was trained with no longer loads ({problems}); export "
            "describes the run by it: resume the run with that setting changed, and export the checkpoint it writes"
        ) from None
    kept = checked.train.model_copy(update={"accumulation_steps": train["accumulation_steps"]})
    return checked.model_copy(update={"train": kept})
