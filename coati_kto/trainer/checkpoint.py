"""Atomic, exactly resumable checkpoints and the final Hugging Face export.

Layout of ``root/step-N/``: ``model/`` (booster, sharded safetensors), ``optimizer/`` (booster, sharded),
``lr_scheduler.pt``, ``trainer_state/rank-R.pt`` (the trainer's state, this rank's RNG states and the fp16 loss scaler),
``master_weights/rank-R.pt`` (this rank's fp32 master shard, mixed precision only), ``meta.json`` and
``COMPLETE``. ColossalAI's optimizer checkpoint holds Adam's moments but not the fp32 master weights: on load
it rebuilds them from the bf16 model, and a resumed bf16 run drifts. Saving the masters makes it exact.

``root`` must be one directory that every rank sees (a shared filesystem on multi-node runs).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from colossalai.booster import Booster

from coati_kto.errors import UserError
from coati_kto.families.shardformer import tp_change_refusal
from coati_kto.models.lora import base_module
from coati_kto.parallel.distributed import ParallelLayout, barrier, gather_objects, on_rank0
from coati_kto.parallel.loss_scale import loss_scale, loss_scaler_state, restore_loss_scaler
from coati_kto.parallel.store_waits import first_failure, wait_for_all
from coati_kto.runtime.durable import (
    recover,
    remove_in_background,
    replace_dir,
    sync_dir,
    sync_dirs,
    sync_files,
    write_dir,
    write_synced,
)
from coati_kto.runtime.lineage import resolve_checkpoint, resume_choice
from coati_kto.runtime.run_dir import (
    COMPLETE,
    LATEST,
    MASTER_WEIGHTS_DIR,
    TRAINER_STATE_DIR,
    complete_checkpoints,
    saved_trainer_state,
)
from coati_kto.trainer.checkpoint_runs import PRUNE_WAIT_S, RunLineage, prune, warn
from coati_kto.trainer.checkpoint_state import (
    load_booster_state,
    load_masters,
    master_shards,
    masters_fit,
    old_dp_states,
    restore_masters,
    rng_state,
    set_rng_state,
)
from coati_kto.trainer.export import (
    fp32_state,
    merged_over_stages,
    save_tied_weights_once,
    write_atomic,
    write_hf,
)
from coati_kto.trainer.write_failures import describe, held_write_failures, with_disk_hint


class CheckpointSaveError(UserError):
    """A checkpoint write failed on some rank (disk full, permission denied); raised on every rank alike."""

    same_on_every_rank = True


class CheckpointManager:
    """Saves and restores training state under ``root``; keeps the last ``keep_last`` complete checkpoints."""

    def __init__(
        self, root: str | Path, booster: Booster, layout: ParallelLayout, keep_last: int = 2
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.booster = booster
        self.layout = layout
        self.keep_last = keep_last
        # Main rank: called with each checkpoint once it is complete, before pruning (output.push_to_hub's uploads).
        self.on_complete: Callable[[Path], None] | None = None
        # The id of the last checkpoint this run saved or resumed from in ``root`` (or of the fork it started):
        # each save's meta.json names it as ``previous``, which is how resume=auto tells this run's saves from a
        # copy's or an abandoned run's (coati_kto.runtime.lineage).
        self._lineage = RunLineage(self.root)

    # ---- save ---------------------------------------------------------------------------------------------
    def save(self, step: int, model: Any, optimizer: Any, lr_scheduler: Any, trainer_state: dict) -> Path:
        """Every rank calls. Writes ``root/step-{step}/`` atomically; returns its path.

        All ranks write into ``step-N.tmp``; only once every rank is done does the main rank mark it
        ``COMPLETE``, rename it into place and move ``latest``. A failure before that leaves the previous
        checkpoint and ``latest`` untouched. A write that fails on any rank (disk full, permission denied) is
        agreed on at the next synchronisation point instead of a barrier: the partial ``.tmp`` is removed and
        every rank raises CheckpointSaveError naming the rank, the path and the cause (no rank waits for
        train.dist_timeout).
        """
        tmp = self.root / f"step-{step}.tmp"
        try:
            return self._write(step, model, optimizer, lr_scheduler, trainer_state)
        except CheckpointSaveError:
            raise
        except Exception as err:  # this rank failed: join the agreement the other ranks are waiting in
            self._agree(step, tmp, with_disk_hint(err, self.root))
            raise  # not reached: _agree raises

    def _write(self, step: int, model: Any, optimizer: Any, lr_scheduler: Any, trainer_state: dict) -> Path:
        rng = rng_state()  # first: nothing below may consume randomness before it is recorded
        final, tmp = self.root / f"step-{step}", self.root / f"step-{step}.tmp"
        rank = self.layout.rank
        if self.layout.is_main:
            self._clear_leftovers()
            (tmp / TRAINER_STATE_DIR).mkdir(parents=True)
            (tmp / MASTER_WEIGHTS_DIR).mkdir()
        self._agree(step, tmp)
        save_tied_weights_once(base_module(model))
        with held_write_failures():  # a failed write keeps this rank in upstream's gathers (write_failures)
            self.booster.save_model(model, str(tmp / "model"), shard=True, use_safetensors=True)
            self.booster.save_optimizer(optimizer, str(tmp / "optimizer"), shard=True)
            self.booster.save_lr_scheduler(lr_scheduler, str(tmp / "lr_scheduler.pt"))
        per_rank = {"trainer_state": trainer_state, "rng": rng, "loss_scaler": loss_scaler_state(optimizer)}
        torch.save(per_rank, tmp / TRAINER_STATE_DIR / f"rank-{rank}.pt")
        masters = master_shards(model, optimizer)
        if masters:
            torch.save(masters, tmp / MASTER_WEIGHTS_DIR / f"rank-{rank}.pt")
        # On disk before the agreement, so that COMPLETE never vouches for a shard still in a crashed node's page
        # cache. Upstream picks which rank writes each booster file: every rank syncs those (a clean file costs
        # little), and its own per-rank files; the others' are theirs to sync.
        sync_files(tmp, keep=lambda path: _may_have_written(path, rank))
        self._agree(step, tmp)  # every rank's files are on disk
        if self.layout.is_main:
            self._publish(step, tmp, final)
        self._agree(step, tmp)
        return final

    def _clear_leftovers(self) -> None:
        """The main rank, before a save: an interrupted save's ``step-N.tmp``, and the old copy of a step a kill
        caught between the renames that replace it (put back when nothing took its place)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob("step-*.tmp"):  # deleted on a thread: the peers wait in an agreement
            remove_in_background(stale)
        recover(self.root)

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
        """The main rank, once every rank's files are on disk: meta.json, then COMPLETE (each synced, the
        directories' entries before the marker), then ``tmp`` renamed to ``final`` and the pointer moved."""
        meta = {"step": step, **self._layout_meta(), "plugin": type(self.booster.plugin).__name__}
        # every rank's files are on disk (agreed): the ranks whose masters a resume on this layout must find
        meta["master_ranks"] = sorted(
            int(p.stem.split("-")[1]) for p in (tmp / MASTER_WEIGHTS_DIR).glob("rank-*.pt")
        )
        meta.update(self._lineage.next_meta())
        write_synced(tmp / "meta.json", json.dumps(meta, indent=2))
        sync_dirs(tmp)
        # COMPLETE goes in before the rename, so a directory named step-N is never seen half-done.
        write_synced(tmp / COMPLETE, f"step {step}\n")
        sync_dir(tmp)
        # Re-saving a step (an abandoned run's, after a hand resume): the old one aside, the new one in, the old
        # one removed on a thread, waited for as pruning's (the peers wait in an agreement meanwhile); a kill
        # between the renames leaves the old one for the next save to put back.
        removal = replace_dir(tmp, final, background=True)
        if removal is not None:
            removal.join(timeout=PRUNE_WAIT_S)
        self._lineage.saved(meta["id"])
        self._settle(final)

    def _settle(self, final: Path) -> None:
        """The main rank, once ``final`` is complete: the pointer, the uploads, pruning. ``final`` stays whole
        whatever fails here (resume=auto finds it without the pointer), so a failure is a warning, not a failed
        save that stops training."""
        try:
            write_atomic(self.root / LATEST, final.name)
        except OSError as err:
            warn(
                f"{final} is complete, but {LATEST} could not be updated ({describe(err)}); resume=auto finds it"
            )
        if self.on_complete is not None:
            try:
                self.on_complete(final)
            except Exception as err:  # noqa: BLE001 - an upload that cannot start is not a failed save
                # as CheckpointUploads says its own failures (coati_kto.outputs.push): the retry command
                repo = getattr(getattr(self.on_complete, "push", None), "repo_id", None) or "OWNER/NAME"
                warn(
                    f"checkpoint {final.name} not uploaded ({describe(err)}); it is complete and the run goes on; "
                    f"to upload it while output.keep_last keeps it: `hf upload {repo} {final} --revision {final.name}`"
                )
        self._prune(keep=final)

    def resumed_from(self, checkpoint: Path) -> None:
        """The main rank, after loading ``checkpoint``: the lineage its saves continue, or the fork a resume from
        another checkpoint of this directory starts (``checkpoint_runs.RunLineage.resumed_from``)."""
        self._lineage.resumed_from(checkpoint, self.layout.is_main)

    def _agree(self, step: int, tmp: Path, failure: BaseException | None = None) -> None:
        """Every rank calls at the same point (it replaces a barrier): gathers each rank's failure, if any.

        On any failure: the main rank removes ``tmp``, then every rank raises the same CheckpointSaveError.
        """
        failed = self._first_failure(f"write {tmp.name}", tmp, failure)
        if failed is None:
            return
        rank, text = failed
        last = self.resume_auto_here()
        kept = f"the last complete checkpoint is {last}" if last else "no complete checkpoint was written yet"
        raise CheckpointSaveError(
            f"checkpoint step-{step} could not be written (rank {rank}: {text}); removed the partial "
            f"{tmp.name}, {kept}"
        )

    def _layout_meta(self) -> dict[str, int]:
        return {
            "world_size": self.layout.world_size,
            "dp_size": self.layout.dp_size,
            "tp_size": self.layout.tp_size,
            "sp_size": self.layout.sp_size,
            "pp_size": self.layout.pp_size,
        }

    def _prune(self, keep: Path) -> None:
        prune(self.root, keep, self.keep_last)

    def _complete(self) -> list[Path]:
        """Complete checkpoints under root, oldest step first."""
        return complete_checkpoints(self.root)

    # ---- resolve / load -----------------------------------------------------------------------------------
    def resolve(self, resume: str | None) -> Path | None:
        """None -> None; 'auto' -> the latest complete checkpoint under root, or None; a path -> that checkpoint.

        Reads the filesystem only (no collectives), so any rank may call it. Raises UserError for a path that
        is missing or not a complete checkpoint.
        """
        return resolve_checkpoint(self.root, resume)

    def resolve_everywhere(self, resume: str | None) -> Path | None:
        """The checkpoint to load, checked for damage (``lineage.resume_choice``: a damaged one named by path is
        refused, auto falls back past it), decided on global rank 0: its answer (or its UserError) on every rank;
        every rank calls. One rank decides, so all ranks load the same checkpoint even when a save lands between
        their looks."""
        return on_rank0(lambda: resume_choice(self.root, resume)[0], "resolve the checkpoint")

    def resume_auto_here(self) -> Path | None:
        """What ``resume=auto`` would load (``resume_choice``'s damage check), read by the calling rank alone; None
        when no checkpoint is intact. No collective: it names the checkpoint at a stop, where a second Ctrl-C may
        already be ending a peer (a broadcast there turned that peer's 130 into this rank's collective failure)."""
        with contextlib.suppress(UserError):
            return resume_choice(self.root, "auto")[0]
        return None

    def saved_state(self, path: Path) -> dict:
        """Rank 0's saved trainer state: ``config`` (the resolved config the run trained with,
        ``Config.model_dump(mode="json")``) and ``train_data`` (its training data's digest), each None in a
        checkpoint saved without it. Reads a file only; every rank may call."""
        return saved_trainer_state(path, 0)["trainer_state"]

    def load(self, path: Path, model: Any, optimizer: Any, lr_scheduler: Any, rng: bool = True) -> dict:
        """Every rank calls. Restores model, optimizer (with fp32 masters), scheduler and this rank's RNG (not
        with ``rng=False``: an export, which draws no random numbers).

        Returns this rank's trainer_state. With another layout (world, dp or tp size) than at save time the booster
        re-shards model and optimizer, but per-rank RNG and master shards cannot be matched: the masters are
        rebuilt from the model weights and RNG is left as is (a warning says so). The data position then needs
        every old rank's state: global rank 0 reads them all and broadcasts them, returned under
        ``rank_states`` (one per old data-parallel rank, in dp-rank order).
        """
        path = Path(path)
        rank = self.layout.rank
        meta = json.loads((path / "meta.json").read_text())
        why = tp_change_refusal(type(base_module(model)).__name__, meta.get("tp_size"), self.layout.tp_size)
        if why is not None:  # every rank reads the same meta.json: every rank raises
            raise UserError(f"train.resume {path}: {why}")
        load_booster_state(self.booster, path, model, optimizer, lr_scheduler)
        # sp_size and pp_size are absent from checkpoints written before them: those ran at 1.
        same_layout = all(
            meta.get(k, 1 if k in ("sp_size", "pp_size") else None) == v
            for k, v in self._layout_meta().items()
        )
        master_file = path / MASTER_WEIGHTS_DIR / f"rank-{rank}.pt"
        if same_layout and master_file.is_file():
            masters = load_masters(master_file)
            # whole: one gradient replica (ZeRO's group is dp x sp under sequence parallelism)
            whole = self.layout.gradient_replicas == 1
            if masters_fit(model, optimizer, masters, whole):
                restore_masters(model, optimizer, masters, whole)
            elif self.layout.is_main:  # the same on every rank: the stage is the run's
                warn("plugin.zero_stage changed since the save: fp32 master weights rebuilt from its weights")
        rebuilt = ", fp32 master weights rebuilt from its weights" if master_shards(model, optimizer) else ""
        if same_layout:
            saved = saved_trainer_state(path, rank)
            restore_loss_scaler(optimizer, saved.get("loss_scaler"))  # fp16: absent from older checkpoints
            if rng:
                set_rng_state(saved["rng"])  # last: loading above must not advance the restored generators
            return saved["trainer_state"]
        if (
            loss_scale(optimizer) is not None
        ):  # fp16: the scale is the same on every rank (a global overflow vote)
            restore_loss_scaler(optimizer, saved_trainer_state(path, 0).get("loss_scaler"))
        if (
            rng and self.layout.is_main
        ):  # one line for the run, not a logging record per rank; none for an export
            warn(f"the parallel layout changed since the save: RNG states not restored{rebuilt}")
        states = on_rank0(lambda: old_dp_states(path, meta), "read the checkpoint's data position")
        return {**states[0], "rank_states": states}

    # ---- export -------------------------------------------------------------------------------------------
    def export_hf(
        self,
        model: Any,
        tokenizer: Any,
        out_dir: str | Path,
        fp32_masters: dict[str, torch.Tensor] | None = None,
        again: str | None = None,
    ) -> Path:
        """Every rank calls (tensor-parallel shards are gathered by ``state_dict()``, a collective there).

        The main rank writes a Hugging Face model directory (config.json, model.safetensors, tokenizer
        files) in the training dtype, or in fp32 from ``fp32_masters`` (``parallel.masters.gathered_masters``),
        into ``out_dir.tmp`` and renames it into place: ``out_dir`` is whole or absent. A failed write (disk
        full) removes the partial directory and raises CheckpointSaveError (``again``: write_final)."""
        out = Path(out_dir)
        module = model.unwrap()
        save_tied_weights_once(module)
        whole = module.state_dict()  # every rank: tensor-parallel gathers
        # in host memory where it is read: by the writer, and each pipeline stage's own, to send to the writer
        kept = self.layout.is_main or self.layout.pp_size > 1
        state = {k: v.detach().cpu().contiguous() for k, v in whole.items()} if kept else {}
        del whole
        if fp32_masters is not None and kept:
            state = fp32_state(state, fp32_masters)
        if self.layout.pp_size > 1:  # each stage holds its own layers: the main rank writes them all
            state = merged_over_stages(state, module, self.layout.pp_group, keep=self.layout.is_main)
        return self.write_final(
            out, lambda tmp: write_hf(module, state, tokenizer, tmp, fp32=fp32_masters is not None), again
        )

    def write_final(self, out: Path, write: Callable[[Path], None], again: str | None = None) -> Path:
        """Every rank calls: the main rank runs ``write(directory)`` into a new directory of its own beside ``out``
        (``runtime.durable.write_dir``: synced, then swapped in with the old one renamed aside), so ``out`` is
        whole (old or new) or absent at every moment and no folder of the user's beside it is touched; the others
        wait. A failed write (disk full) removes the partial directory and raises CheckpointSaveError on every
        rank, ending with ``again`` (how to write it again; default: the checkpoint resume=auto exports it from)."""
        failure = None
        if self.layout.is_main:
            try:
                write_dir(out, write)
            except Exception as err:  # the others wait in the gather below; all raise the same error
                failure = with_disk_hint(err, out.parent)
        failed = self._first_failure(f"write {out.name}", None, failure, solo=True)
        if failed is not None:
            if again is None and (last := self.resume_auto_here()) is not None:
                again = f"train.resume=auto exports it again from {last}"
            raise CheckpointSaveError(
                f"the final model could not be written to {out} (rank {failed[0]}: {failed[1]}); removed its "
                "partial copy" + (f"; {again}" if again else "")
            )
        return out

    def _first_failure(
        self, what: str, tmp: Path | None, failure: BaseException | None, solo: bool = False
    ) -> tuple[int, str] | None:
        """Every rank calls: the first rank that failed and its one-line cause, or None. On a failure the main
        rank has removed ``tmp`` (if any) before any rank returns.

        ``solo``: the others wait for the main rank's ``what`` (``write final``: hours for a large model on a
        shared filesystem), through the store (``store_waits``: train.file_wait_timeout). A checkpoint's
        agreements stay collectives: every rank writes its own part at once, and a rank killed meanwhile (the OOM
        killer, a SIGKILL) is then noticed by the others at once, through its closed sockets, where a store wait
        would wait for the heartbeat."""
        line = None if failure is None else describe(failure)
        if solo:
            failed = first_failure(line, what)
        else:
            failed = next(((r, t) for r, t in enumerate(gather_objects(line)) if t is not None), None)
        if failed is None:
            return None
        if self.layout.is_main and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if solo:
            wait_for_all(f"the main rank to clean up after {what}")  # cleaned before anyone reports it
        else:
            barrier()
        return failed


def _may_have_written(path: Path, rank: int) -> bool:
    """Whether ``rank`` syncs ``path`` of a checkpoint being saved: anything but another rank's own file (its
    trainer state, its master shard)."""
    mine = path.parent.name not in (TRAINER_STATE_DIR, MASTER_WEIGHTS_DIR) or path.name == f"rank-{rank}.pt"
    return mine
