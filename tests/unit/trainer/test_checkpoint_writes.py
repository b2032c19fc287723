"""What the main rank does once a checkpoint's files are written (CheckpointManager._publish: synced, marked,
renamed, settled) and how final/ is written (write_final): one process, no booster."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from coati_kto.runtime.durable import sync_files
from coati_kto.runtime.run_dir import COMPLETE, LATEST
from coati_kto.trainer.checkpoint import CheckpointManager, CheckpointSaveError, _may_have_written

LAYOUT = SimpleNamespace(is_main=True, world_size=1, dp_size=1, tp_size=1, sp_size=1, pp_size=1, rank=0)


def _manager(root: Path, keep_last: int = 2) -> CheckpointManager:
    booster = SimpleNamespace(plugin=SimpleNamespace())
    return CheckpointManager(root, booster=booster, layout=LAYOUT, keep_last=keep_last)


def _written(root: Path, step: int) -> Path:
    """``step-N.tmp`` as every rank leaves it for the main rank: the booster's folders and per-rank files."""
    tmp = root / f"step-{step}.tmp"
    for folder in ("model", "trainer_state", "master_weights"):
        (tmp / folder).mkdir(parents=True)
    (tmp / "model" / "model-00001.safetensors").write_bytes(b"weights")
    for rank in (0, 1):
        (tmp / "trainer_state" / f"rank-{rank}.pt").write_bytes(b"state")
    return tmp


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths os.fsync is called on, in order."""
    calls: list[str] = []
    real = os.fsync

    def record(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_a_checkpoint_is_on_disk_before_it_is_marked_complete_and_renamed(
    tmp_path: Path, synced: list[str]
) -> None:
    """Nothing was fsynced before COMPLETE was written and the folder renamed: after a node crash a checkpoint
    marked complete could hold truncated shards."""
    tmp = _written(tmp_path, 4)
    # each rank, before the agreement: the booster's files and its own per-rank files, not another rank's
    assert sync_files(tmp, keep=lambda path: _may_have_written(path, 1)) == 2
    assert synced == [
        str(tmp / "model" / "model-00001.safetensors"),
        str(tmp / "trainer_state" / "rank-1.pt"),
    ]
    synced.clear()
    _manager(tmp_path)._publish(4, tmp, tmp_path / "step-4")
    meta, complete = synced.index(str(tmp / "meta.json")), synced.index(str(tmp / COMPLETE))
    assert meta < synced.index(str(tmp / "model")) < complete  # the entries before the marker
    assert synced.index(str(tmp)) < complete < synced.index(str(tmp), complete)  # and the marker's entry
    renamed = synced.index(str(tmp_path))  # the rename into step-4, before the pointer (written atomically)
    assert complete < renamed < synced.index(str(tmp_path / f"{LATEST}.tmp"))
    assert (tmp_path / "step-4" / COMPLETE).is_file() and (tmp_path / LATEST).read_text() == "step-4"


def test_a_step_saved_again_replaces_the_old_one_whole(tmp_path: Path, synced: list[str]) -> None:
    manager = _manager(tmp_path)
    manager._publish(4, _written(tmp_path, 4), tmp_path / "step-4")
    first = json.loads((tmp_path / "step-4" / "meta.json").read_text())["id"]
    manager._publish(4, _written(tmp_path, 4), tmp_path / "step-4")
    again = json.loads((tmp_path / "step-4" / "meta.json").read_text())
    assert again["id"] != first and again["previous"] == first
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-4"]


def test_an_upload_that_fails_to_start_leaves_the_checkpoint_counted_and_pruning_done(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """on_complete (output.push_to_hub.checkpoints) raising escaped into save()'s error path: a complete
    checkpoint reported as "could not be written", and pruning skipped."""
    manager = _manager(tmp_path, keep_last=1)
    manager._publish(2, _written(tmp_path, 2), tmp_path / "step-2")

    class Uploads:  # as coati_kto.outputs.push.CheckpointUploads, failing as it starts
        push = SimpleNamespace(repo_id="me/kto-ckpt")

        def __call__(self, checkpoint: Path) -> None:
            raise OSError(13, "Permission denied", str(tmp_path / ".hub_uploads"))

    manager.on_complete = Uploads()
    manager._publish(4, _written(tmp_path, 4), tmp_path / "step-4")  # no exception
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-4"]  # step-2 pruned
    assert (tmp_path / LATEST).read_text() == "step-4"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: checkpoint step-4 not uploaded (Permission denied: {tmp_path / '.hub_uploads'}); it is "
        "complete and the run goes on; to upload it while output.keep_last keeps it: "
        f"`hf upload me/kto-ckpt {tmp_path / 'step-4'} --revision step-4`"
    ]


def test_final_is_written_beside_the_users_folders_without_touching_them(tmp_path: Path) -> None:
    """write_final deleted a folder of the user's named final.tmp (its fixed temporary name) and deleted final/
    before renaming the new one in."""
    out = tmp_path / "final"
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "notes.txt").write_text("mine")
    manager = _manager(tmp_path / "checkpoints")
    for text in ("first", "second"):
        manager.write_final(out, lambda d, text=text: (d / "config.json").write_text(text))
    assert (out / "config.json").read_text() == "second"
    assert (tmp_path / "final.tmp" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "final.tmp"]

    def full(directory: Path) -> None:
        (directory / "model.safetensors").write_bytes(b"par")
        raise OSError(28, "No space left on device", str(directory / "model.safetensors"))

    with pytest.raises(CheckpointSaveError) as err:
        manager.write_final(out, full)
    assert str(err.value).startswith(f"the final model could not be written to {out} (rank 0: No space left")
    assert str(err.value).endswith("); removed its partial copy")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "final.tmp"]
    assert (out / "config.json").read_text() == "second"


def test_a_failed_export_says_to_export_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk under ``coati-kto export`` said "train.resume=auto exports it again from step-N": training's
    advice, which writes final/, not the export's folder. The line now says to run the export again."""
    from coati_kto.recipe import save

    manager = _manager(tmp_path / "checkpoints")

    def full(directory: Path) -> None:
        raise OSError(28, "No space left on device", str(directory / "model.safetensors"))

    def write_weights(trainer, tokenizer, target, output, lora, is_main, frozen, again=None) -> Path:  # noqa: ANN001
        return manager.write_final(target, full, again)  # the manager's write with the caller's advice

    monkeypatch.setattr(save, "write_weights", write_weights)
    config = SimpleNamespace(
        training_output=lambda: SimpleNamespace(save_final=True), model=SimpleNamespace(lora=None)
    )
    run = SimpleNamespace(out_dir=tmp_path, tokenizer=None, layout=LAYOUT)
    export = tmp_path / "exports" / "step-4"
    lines = {}
    for where, final_dir in (("export", export), ("final", None)):
        with pytest.raises(CheckpointSaveError) as err:
            save.save_final(config, run, None, {}, final_dir)
        lines[where] = str(err.value)
    export_line, final_line = lines["export"], lines["final"]
    assert export_line.endswith("); removed its partial copy; run coati-kto export again"), export_line
    # training's own line, with no checkpoint to resume from here (test_checkpoint.py: the one with a checkpoint)
    assert final_line.endswith("); removed its partial copy"), final_line
