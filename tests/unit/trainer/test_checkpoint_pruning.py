"""Which checkpoints the main rank keeps once a save is complete (CheckpointManager._settle: the pointer, then
pruning), on directories laid out by hand: no booster, no process group."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from coati_kto.runtime.lineage import resolve_checkpoint
from coati_kto.runtime.run_dir import COMPLETE, LATEST
from coati_kto.trainer.checkpoint import CheckpointManager


def _manager(root: Path, keep_last: int) -> CheckpointManager:
    return CheckpointManager(root, booster=None, layout=SimpleNamespace(is_main=True), keep_last=keep_last)


def _complete(root: Path, step: int) -> Path:
    path = root / f"step-{step}"
    (path / "model").mkdir(parents=True)
    (path / "model" / "shard.bin").write_bytes(b"x")
    (path / COMPLETE).write_text(f"step {step}\n")
    return path


def _steps(root: Path) -> list[str]:
    return sorted((p.name for p in root.glob("step-*")), key=lambda n: int(n.split("-")[1]))


@pytest.mark.parametrize("keep_last", [1, 2, 3, 4, 6])
def test_keep_last_checkpoints_are_kept(tmp_path: Path, keep_last: int) -> None:
    """keep_last 4 or more kept 3: the slice of checkpoints to remove was others[:len - (keep_last - 1)], whose
    negative bound removed from the front while fewer than keep_last - 1 others existed."""
    manager = _manager(tmp_path, keep_last)
    for step in range(1, 9):
        manager._settle(_complete(tmp_path, step))
        assert _steps(tmp_path) == [f"step-{s}" for s in range(max(1, step - keep_last + 1), step + 1)], step
    assert (tmp_path / LATEST).read_text() == "step-8"


def test_a_run_resumed_by_hand_keeps_its_own_checkpoints_not_the_abandoned_ones(tmp_path: Path) -> None:
    """Run A saved step-10, 20 and 30; run B resumed from step-10: its first save removed step-10 (the one it
    resumed from) and kept A's step-20 and step-30. Higher steps are left alone and not counted now, and B's
    saves replace them as B reaches them."""
    manager = _manager(tmp_path, 2)
    for step in (10, 20, 30):
        _complete(tmp_path, step)
    manager.resumed_from(tmp_path / "step-10")
    assert (tmp_path / LATEST).read_text() == "step-10"
    manager._settle(_complete(tmp_path, 15))
    assert _steps(tmp_path) == ["step-10", "step-15", "step-20", "step-30"]
    assert resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-15"
    shutil.rmtree(tmp_path / "step-20")  # B re-saves step-20 (CheckpointManager._write replaces it)
    manager._settle(_complete(tmp_path, 20))
    assert _steps(tmp_path) == ["step-15", "step-20", "step-30"]


def test_a_checkpoint_that_cannot_be_removed_is_a_warning_and_no_longer_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A delete failing partway (NFS's .nfsXXXX files: EBUSY) stopped training with "checkpoint step-4 could not
    be written" though step-4 was complete, and left step-2 half deleted with its COMPLETE marker: a husk that
    train.resume and export --checkpoint took for a checkpoint."""
    manager = _manager(tmp_path, 1)
    manager._settle(_complete(tmp_path, 2))
    real = shutil.rmtree

    def busy(path: Path, *args: object, **kwargs: object) -> None:
        (Path(path) / "model" / "shard.bin").unlink()
        raise OSError(16, "Device or resource busy", str(Path(path) / "model" / ".nfs0001"))

    monkeypatch.setattr(shutil, "rmtree", busy)
    manager._settle(_complete(tmp_path, 4))
    _deleted("step-2")
    monkeypatch.setattr(shutil, "rmtree", real)
    (gone,) = [p for p in tmp_path.iterdir() if p.name.startswith(".step-2.coati-kto-gone-")]
    assert capsys.readouterr().err.splitlines() == [
        f"warning: could not remove {tmp_path / 'step-2'}, now {gone} (Device or resource busy: "
        f"{gone / 'model' / '.nfs0001'}); remove it by hand"
    ]
    assert not (gone / COMPLETE).exists() and not (tmp_path / "step-2").exists()
    assert resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-4"


def _deleted(name: str) -> None:
    """Wait for the background delete of checkpoint ``name`` (coati_kto.runtime.durable.remove_in_background)."""
    import threading

    for thread in [t for t in threading.enumerate() if t.name == f"remove {name}"]:
        thread.join(timeout=20)


def test_pruning_deletes_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From an audit: the main rank deleted old checkpoints inside a save, between two agreements, while every
    other rank waited in a collective bounded by train.dist_timeout; deleting a large model's checkpoint on a
    network filesystem outlasts it, and the job died after a good save. The old checkpoint now leaves its name at
    once (a rename), and is deleted on a thread of its own."""
    import threading
    import time

    deleting, release = threading.Event(), threading.Event()
    real_rmtree = shutil.rmtree

    def slow_rmtree(path: object, *args: object, **kwargs: object) -> None:
        deleting.set()
        release.wait(timeout=20)  # a filesystem that takes its time
        real_rmtree(path, *args, **kwargs)

    from coati_kto.trainer import checkpoint_runs

    manager = _manager(tmp_path, 1)
    manager._settle(_complete(tmp_path, 2))
    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    monkeypatch.setattr(checkpoint_runs, "PRUNE_WAIT_S", 0.5)  # a quick delete is waited for, a slow one not
    started = time.monotonic()
    manager._settle(_complete(tmp_path, 4))
    assert time.monotonic() - started < 5  # not held by the delete
    assert _steps(tmp_path) == ["step-4"] and resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-4"
    assert deleting.wait(timeout=10)  # under way, under a name of ours
    (gone,) = [p for p in tmp_path.iterdir() if ".step-2.coati-kto-gone-" in p.name]
    release.set()
    _deleted("step-2")
    assert not gone.exists() and sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-4"]


class _SlowDeletes:
    """shutil.rmtree held on the deleting threads (``remove NAME``) until ``release``; calls elsewhere counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import threading

        self.deleting, self.release = threading.Event(), threading.Event()
        self.elsewhere: list[str] = []
        real_rmtree = shutil.rmtree

        def rmtree(path: object, *args: object, **kwargs: object) -> None:
            if threading.current_thread().name.startswith("remove "):
                self.deleting.set()
                self.release.wait(timeout=20)  # a filesystem that takes its time
            else:
                self.elsewhere.append(Path(str(path)).name)
            real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(shutil, "rmtree", rmtree)


def test_a_step_saved_again_and_a_killed_saves_tmp_are_deleted_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """From the audit of pruning's fix: the main rank still deleted, inside a save's agreements, the old copy of a
    step saved again (after a hand resume) and a killed save's step-N.tmp; and the next save's recover() deleted a
    directory a pruning thread was deleting (both deleting one tree: a spurious "could not remove" warning)."""
    import time

    from coati_kto.runtime.durable import recover, replace_dir

    slow = _SlowDeletes(monkeypatch)
    old = _complete(tmp_path, 2)
    new = tmp_path / "step-2.tmp"
    (new / "model").mkdir(parents=True)
    (new / COMPLETE).write_text("step 2 again\n")
    started = time.monotonic()
    replace_dir(new, old, background=True)
    assert time.monotonic() - started < 5 and slow.deleting.wait(timeout=10)
    assert (old / COMPLETE).read_text() == "step 2 again\n"  # the new copy is in place at once
    (gone,) = [p for p in tmp_path.iterdir() if ".step-2.coati-kto-gone-" in p.name]
    recover(tmp_path)  # the next save's: the thread's directory is left to it
    assert gone.exists() and slow.elsewhere == []

    stale = _complete(tmp_path, 4).rename(tmp_path / "step-4.tmp")  # a save killed before its rename
    manager = _manager(tmp_path, 2)
    started = time.monotonic()
    manager._clear_leftovers()
    assert time.monotonic() - started < 5 and not stale.exists() and slow.elsewhere == []
    slow.release.set()
    _deleted("step-2")
    _deleted("step-4.tmp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2"]
    assert capsys.readouterr().err == ""  # no delete raced another
