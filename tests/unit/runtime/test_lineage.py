"""Which checkpoint a resume takes after a hand resume (a fork), and what a damaged one gives: on directories laid
out by hand, no booster, no process group."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from coati_kto.errors import UserError
from coati_kto.runtime.checkpoint_check import damage
from coati_kto.runtime.lineage import resolve_checkpoint, resume_choice
from coati_kto.runtime.run_dir import COMPLETE, FORK, LATEST
from coati_kto.trainer.checkpoint import CheckpointManager


def _saved(root: Path, step: int, meta: dict) -> Path:
    """A checkpoint with every file a resume reads (tiny ones), ``meta`` its meta.json's id/previous/fork."""
    path = root / f"step-{step}"
    for folder in ("trainer_state", "model", "optimizer"):
        (path / folder).mkdir(parents=True)
    save_file({"w": torch.arange(64.0).reshape(8, 8)}, path / "model" / "model-00001.safetensors")
    index = {"metadata": {}, "weight_map": {"w": "model-00001.safetensors"}}
    (path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({"state": {0: torch.zeros(8)}}, path / "optimizer" / "pytorch_optim-00001.bin")
    torch.save([{"lr": 1.0}], path / "optimizer" / "pytorch_optim_group.bin")
    index = {
        "metadata": {"param_groups": "pytorch_optim_group.bin"},
        "weight_map": {"0": "pytorch_optim-00001.bin"},
    }
    (path / "optimizer" / "pytorch_optim.bin.index.json").write_text(json.dumps(index))
    torch.save({"last_epoch": step}, path / "lr_scheduler.pt")
    torch.save({"trainer_state": {"global_step": step}}, path / "trainer_state" / "rank-0.pt")
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 1, **meta}))
    (path / COMPLETE).write_text(f"step {step}\n")
    return path


def _manager(root: Path, keep_last: int = 8) -> CheckpointManager:
    return CheckpointManager(root, booster=None, layout=SimpleNamespace(is_main=True), keep_last=keep_last)


def _run_a(root: Path, steps: tuple[int, ...] = (12, 16, 20, 24)) -> None:
    """Run A's saves, each naming the one before it; the pointer on the last."""
    previous = None
    for step in steps:
        _saved(root, step, {"id": f"a{step}", "previous": previous})
        previous = f"a{step}"
    (root / LATEST).write_text(f"step-{steps[-1]}")


def _save(manager: CheckpointManager, step: int, pointer: bool = True) -> Path:
    """What CheckpointManager._publish records of a save (``pointer``: False for a kill before the pointer moved)."""
    meta = manager._lineage.next_meta()
    path = _saved(manager.root, step, meta)
    manager._lineage.saved(meta["id"])
    if pointer:
        manager._settle(path)
    return path


def test_auto_after_a_crashed_hand_resume_stays_on_the_checkpoint_resumed_from(tmp_path: Path) -> None:
    """Run B resumed from step-12 by hand and was killed before its first save: `latest` said step-12, but
    train.resume=auto went on to the abandoned run's step-24 (its step-16 names step-12's id as previous, as B's
    first save did). Now B forks: its saves name a fresh id."""
    _run_a(tmp_path)
    b = _manager(tmp_path)
    b.resumed_from(tmp_path / "step-12")
    assert (tmp_path / LATEST).read_text() == "step-12"
    assert resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-12"
    c = _manager(tmp_path)  # the run after the crash: auto resumes the fork, and continues it
    c.resumed_from(resolve_checkpoint(tmp_path, "auto"))
    fork = json.loads((tmp_path / FORK).read_text())
    assert c._lineage.previous == fork["id"] == b._lineage.previous
    assert fork == {"checkpoint": "step-12", "from": "a12", "id": fork["id"]}


def test_a_forks_save_the_pointer_missed_beats_the_abandoned_runs_higher_step(tmp_path: Path) -> None:
    """B saved step-15 (a step A never saved) and was killed between the rename and the pointer's update:
    max(following) took A's step-16 (which names step-12's id too) over B's step-15."""
    _run_a(tmp_path)
    b = _manager(tmp_path)
    b.resumed_from(tmp_path / "step-12")
    fifteen = _save(b, 15, pointer=False)
    assert json.loads((fifteen / "meta.json").read_text())["fork"]["checkpoint"] == "step-12"
    assert resolve_checkpoint(tmp_path, "auto") == fifteen
    seventeen = _save(b, 17, pointer=False)  # and the one after it
    assert resolve_checkpoint(tmp_path, "auto") == seventeen


def test_keep_last_counts_the_runs_own_checkpoints_not_the_abandoned_ones(tmp_path: Path) -> None:
    """keep_last 2, B forked at step-12 of A (4, 8, 12, 16, 20): at B's step-18 the old rule kept the two highest
    lower steps, A's step-16 and B's step-18, and deleted B's own step-14. Now the lineage counts: A's lower
    steps go, A's higher step-20 is left until B saves over it."""
    _run_a(tmp_path, (4, 8, 12, 16, 20))
    b = _manager(tmp_path, keep_last=2)
    b.resumed_from(tmp_path / "step-12")
    _save(b, 14)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-12", "step-14", "step-16", "step-20"]
    _save(b, 18)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-14", "step-18", "step-20"]
    assert resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-18"


def test_resuming_a_checkpoint_saved_before_ids_starts_a_traceable_lineage(tmp_path: Path) -> None:
    """A checkpoint without an id (saved before 2026-12-01) gave its resumed run's saves no previous to follow."""
    old = _saved(tmp_path, 6, {})
    (tmp_path / LATEST).write_text("step-6")
    b = _manager(tmp_path)
    b.resumed_from(old)
    eight = _save(b, 8, pointer=False)
    assert resolve_checkpoint(tmp_path, "auto") == eight


# ---- damaged checkpoints ------------------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "meta.json removed": (lambda p: (p / "meta.json").unlink(), "meta.json is missing"),
    "trainer state removed": (
        lambda p: (p / "trainer_state" / "rank-0.pt").unlink(),
        "trainer_state/rank-0.pt is missing",
    ),
    "model shard cut short": (
        lambda p: _truncate(p / "model" / "model-00001.safetensors"),
        "model/model-00001.safetensors is cut short",
    ),
    "optimizer shard cut short": (
        lambda p: _truncate(p / "optimizer" / "pytorch_optim-00001.bin"),
        "optimizer/pytorch_optim-00001.bin is cut short or not a torch file",
    ),
    "param groups removed": (
        lambda p: (p / "optimizer" / "pytorch_optim_group.bin").unlink(),
        "optimizer/pytorch_optim_group.bin is missing",
    ),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_naming_the_one_before_it(tmp_path: Path, case: str) -> None:
    """A checkpoint marked COMPLETE with a file gone or cut short was a raw traceback from the load
    (FileNotFoundError, SafetensorError: invalid header length). By path it is refused in one line naming the
    intact one before it; auto passes over it to that one, with a warning."""
    _run_a(tmp_path, (16, 20, 24))
    spoil, said = DAMAGE[case]
    twenty_four = tmp_path / "step-24"
    assert damage(twenty_four) is None
    spoil(twenty_four)
    assert damage(twenty_four).startswith(said)
    with pytest.raises(UserError) as err:
        resume_choice(tmp_path, str(twenty_four))
    assert str(err.value).startswith(
        f"train.resume: checkpoint {twenty_four} is marked complete but damaged: {said}"
    )
    assert str(err.value).endswith(f"; the one before it is intact: train.resume={tmp_path / 'step-20'}")
    assert "\n" not in str(err.value)
    chosen, warning = resume_choice(tmp_path, "auto")
    assert chosen == tmp_path / "step-20"
    assert warning.startswith(
        f"warning: train.resume=auto: passed over damaged checkpoint(s) step-24 ({said}"
    )
    assert warning.endswith("using step-20, the intact one before them in this run")


def test_auto_with_no_intact_checkpoint_left_is_refused(tmp_path: Path) -> None:
    _run_a(tmp_path, (20, 24))
    (tmp_path / "step-24" / "meta.json").unlink()
    (tmp_path / "step-20" / "lr_scheduler.pt").unlink()
    with pytest.raises(
        UserError, match=r"^train.resume=auto: checkpoint .*step-24 is marked complete but damaged: "
    ):
        resume_choice(tmp_path, "auto")
    manager = _manager(tmp_path)  # every rank gets rank 0's verdict (one process here: it is rank 0)
    with pytest.raises(UserError, match="no earlier checkpoint of its run is intact"):
        manager.resolve_everywhere("auto")


def test_a_stop_names_the_checkpoint_resume_auto_will_load(tmp_path: Path) -> None:
    """The stop's message named the newest checkpoint by marker only ("checkpoint .../step-24; resume with
    train.resume=auto") while resume=auto passed over it, damaged, to step-20. It now names resume=auto's own
    choice, and none when no checkpoint is intact (resume=auto refuses)."""
    from coati_kto.runtime.signals import StopSignals, TrainingStoppedError
    from coati_kto.trainer.kto import KTOTrainer

    _run_a(tmp_path, (16, 20, 24))
    (tmp_path / "step-24" / "trainer_state" / "rank-0.pt").unlink()
    trainer = SimpleNamespace(  # what _stop reads: the step's save is done (step-24 above)
        _interval=SimpleNamespace(steps=0),
        _save=lambda epoch: None,
        checkpoint_manager=_manager(tmp_path),  # one process: it is rank 0
        stop_signals=StopSignals(),
        _stop_signal="SIGTERM",
        global_step=24,
    )
    with pytest.raises(TrainingStoppedError) as stop:
        KTOTrainer._stop(trainer, 0)
    assert str(stop.value) == (
        f"stopped by SIGTERM after step 24; checkpoint {tmp_path / 'step-20'}; resume with train.resume=auto"
    )
    assert trainer.stop_signals.stop_saved == str(tmp_path / "step-20")
    assert resume_choice(tmp_path, "auto")[0] == tmp_path / "step-20"  # what the resume then loads
    for step in (16, 20):
        (tmp_path / f"step-{step}" / "meta.json").unlink()
    with pytest.raises(TrainingStoppedError) as stop:
        KTOTrainer._stop(trainer, 0)
    assert stop.value.checkpoint is None and trainer.stop_signals.stop_saved is None


def test_a_lost_master_shard_is_damage(tmp_path: Path) -> None:
    """From an audit: a bf16 checkpoint missing one rank's fp32 master shard passed as intact (only the shards
    present were checked), and the resume on the same layout rebuilt that rank's masters from the bf16 weights,
    unsaid: not the exact resume it claims. A save now names the ranks that wrote one (meta.json master_ranks)."""
    manager = CheckpointManager(
        tmp_path,
        booster=SimpleNamespace(plugin=object()),
        layout=SimpleNamespace(is_main=True, world_size=2, dp_size=2, tp_size=1, sp_size=1, pp_size=1),
        keep_last=8,
    )
    tmp = tmp_path / "step-4.tmp"
    _saved(tmp_path, 4, {}).rename(tmp)  # what the ranks wrote, and both ranks' masters
    torch.save({"state": {0: torch.zeros(8)}}, tmp / "trainer_state" / "rank-1.pt")
    (tmp / COMPLETE).unlink()
    (tmp / "master_weights").mkdir()
    for rank in (0, 1):
        torch.save({"w": torch.zeros(4)}, tmp / "master_weights" / f"rank-{rank}.pt")
    manager._publish(4, tmp, tmp_path / "step-4")
    four = tmp_path / "step-4"
    assert json.loads((four / "meta.json").read_text())["master_ranks"] == [0, 1]
    assert damage(four) is None
    (four / "master_weights" / "rank-1.pt").unlink()
    assert damage(four) == "master_weights/rank-1.pt is missing"
    older = json.loads((four / "meta.json").read_text())
    del older["master_ranks"]  # saved before the key: the shards there are all it can check
    (four / "meta.json").write_text(json.dumps(older))
    assert damage(four) is None


def test_a_pointer_or_meta_json_of_garbage_is_passed_over(tmp_path: Path) -> None:
    """From a failure-injection audit: a `latest` pointer of non-UTF-8 bytes and a meta.json whose world_size is
    "two" were UnicodeDecodeError and ValueError tracebacks at resume=auto. Now the pointer is stale (the highest
    complete step) and the meta.json damage (the intact checkpoint before it)."""
    _run_a(tmp_path, (12, 16))
    (tmp_path / LATEST).write_bytes(b"\xff\xfe\x00garbage")
    assert resolve_checkpoint(tmp_path, "auto") == tmp_path / "step-16"
    meta = tmp_path / "step-16" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "world_size": "two"}))
    assert (
        damage(tmp_path / "step-16")
        == "meta.json is unreadable (invalid literal for int() with base 10: 'two')"
    )
    meta.write_text(json.dumps({"step": 16, "world_size": 1, "master_ranks": ["a"]}))
    assert damage(tmp_path / "step-16").startswith("meta.json is unreadable (invalid literal")
