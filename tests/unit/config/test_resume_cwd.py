"""A resume or export from another working directory than the run's: relative paths in the checkpoint's config
are read from the directory the run had (trainer state ``config_cwd``), not from this one. The same files written
otherwise are no change. The same relative text naming other files here is a change for an export; a resume
checks what the files hold instead (check_training_data, the reference's digest: a copy of the project resumes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.config.resume import check_resume
from coati_kto.errors import ConfigError

TRAIN = "data/train.jsonl"


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    """Two working directories, each with its own ``data/train.jsonl`` and ``base/`` model folder."""
    a, b = tmp_path / "A", tmp_path / "B"
    for here in (a, b):
        (here / "data").mkdir(parents=True)
        (here / TRAIN).write_text(f'{{"from": "{here.name}"}}\n')
        (here / "base").mkdir()
    return a, b


def _dump(tmp_path: Path, *overrides: str) -> dict:
    return load_config(write_config(tmp_path, MINIMAL), list(overrides)).model_dump(mode="json")


def _trained_in(a: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> dict:
    monkeypatch.chdir(a)
    return _dump(a.parent, *overrides)


def test_data_files_are_read_from_the_checkpoints_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trained from A with data/train.jsonl, resumed or exported from B: A's file written absolute is the same
    training set (was refused); the same relative text, B's file, is another for an export (was accepted)."""
    a, b = _dirs(tmp_path)
    saved = _trained_in(a, monkeypatch, f"data.train_files=[{TRAIN}]")
    monkeypatch.chdir(b)
    same = _dump(tmp_path, f"data.train_files=[{a / TRAIN}]")
    assert check_resume(saved, same, "step-2", saved_cwd=str(a)) is None
    assert check_resume(saved, same, "step-2", export=True, saved_cwd=str(a)) is None
    relative = _dump(tmp_path, f"data.train_files=[{TRAIN}]")
    assert check_resume(saved, relative, "step-2", saved_cwd=str(a)) is None  # its content is checked apart
    with pytest.raises(ConfigError) as err:
        check_resume(saved, relative, "step-2", export=True, saved_cwd=str(a))
    assert str(err.value).splitlines() == [
        f"coati-kto export step-2: data.train_files [{a / TRAIN}] -> [{b / TRAIN}] (the same relative path, read "
        "from another working directory): differs from the config the checkpoint was trained with",
        f"(run the export from {a}, where the run started, or write these paths absolute)",
    ]


def test_a_recorded_directory_gone_since_reads_the_paths_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a review: a checkpoint whose recorded directory no longer exists (a job's scratch, another machine)
    refused the same folder written absolute, which the comparison from here had accepted."""
    a, _ = _dirs(tmp_path)
    saved = _trained_in(a, monkeypatch, "model.path=base")
    current = _dump(tmp_path, f"model.path={a / 'base'}")
    gone = str(tmp_path / "job-123")
    assert check_resume(saved, current, "step-2", saved_cwd=gone) is None
    assert check_resume(saved, current, "step-2", export=True, saved_cwd=gone) is None


def test_model_folders_are_read_from_the_checkpoints_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _dirs(tmp_path)
    saved = _trained_in(a, monkeypatch, "model.path=base", "model.tokenizer=base")
    monkeypatch.chdir(b)
    same = _dump(tmp_path, f"model.path={a / 'base'}", f"model.tokenizer={a / 'base'}/")
    assert check_resume(saved, same, "step-2", saved_cwd=str(a)) is None
    relative = _dump(tmp_path, "model.path=base", "model.tokenizer=base")
    assert (
        check_resume(saved, relative, "s", saved_cwd=str(a)) is None
    )  # the reference's digest is checked apart
    with pytest.raises(ConfigError) as err:
        check_resume(saved, relative, "s", export=True, saved_cwd=str(a))
    lines = str(err.value).splitlines()
    assert [line.split(": ")[1] for line in lines[:2]] == [
        f"model.path {a / 'base'} -> {b / 'base'} (the same relative path, read from another working directory)",
        f"model.tokenizer {a / 'base'} -> {b / 'base'} (the same relative path, read from another working "
        "directory)",
    ]


def test_what_disk_cannot_tell_apart_and_older_checkpoints_are_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Hub id, a run folder moved since (nothing at the saved directory) and a checkpoint that did not record
    its directory compare their text, as before."""
    a, b = _dirs(tmp_path)
    saved = _trained_in(a, monkeypatch, f"data.train_files=[{TRAIN}]")  # model.path: some/model, a Hub id
    monkeypatch.chdir(b)
    current = _dump(tmp_path, f"data.train_files=[{TRAIN}]")
    assert check_resume(saved, current, "step-2") is None
    assert check_resume(saved, current, "step-2", saved_cwd=str(tmp_path / "moved")) is None
    assert check_resume(saved, current, "step-2", saved_cwd=str(b)) is None


def _checkpoint(step: Path, config: dict, cwd: Path | None) -> Path:
    """A complete checkpoint whose trainer state holds ``config``, read from ``cwd`` (None: not recorded)."""
    import json

    for folder in ("trainer_state", "model", "optimizer"):
        (step / folder).mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 2, "world_size": 1}))
    state = {"global_step": 2, "epoch": 0, "config": config}
    if cwd is not None:
        state["config_cwd"] = str(cwd)
    torch.save({"trainer_state": state}, step / "trainer_state" / "rank-0.pt")
    torch.save({}, step / "lr_scheduler.pt")
    (step / "COMPLETE").write_text("step 2\n")
    return step


def test_a_resume_and_an_export_from_elsewhere_read_the_recorded_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The preflight of `coati-kto train` (train.resume) and `coati-kto export`'s run config take the directory
    the checkpoint recorded; without one, this directory, as before."""
    from coati_kto.recipe.export import run_config
    from coati_kto.runtime.resume_checks import resume_problems

    a, b = _dirs(tmp_path)
    out = f"output.dir={tmp_path / 'out'}"
    saved = _trained_in(a, monkeypatch, f"data.train_files=[{TRAIN}]", out)
    step = _checkpoint(tmp_path / "out" / "checkpoints" / "step-2", saved, a)
    monkeypatch.chdir(b)
    resumed = load_config(
        write_config(tmp_path, MINIMAL), [f"data.train_files=[{TRAIN}]", out, f"train.resume={step}"]
    )
    assert resume_problems(resumed.train, resumed.output, resumed.model_dump(mode="json")) == []
    with pytest.raises(ConfigError, match="data.train_files .* differs from the config the checkpoint"):
        run_config(resumed, step)
    moved = load_config(
        write_config(tmp_path, MINIMAL), [f"data.train_files=[{a / TRAIN}]", out, f"train.resume={step}"]
    )
    assert resume_problems(moved.train, moved.output, moved.model_dump(mode="json")) == []
    # nothing at B's relative path: A's file written absolute is still the run's (it was refused)
    (b / TRAIN).unlink()
    assert resume_problems(moved.train, moved.output, moved.model_dump(mode="json")) == []
    assert run_config(moved, step).data.train_files == [TRAIN]  # the run's config, as it wrote it
    _checkpoint(tmp_path / "old" / "step-2", saved, None)  # before config_cwd: this directory's reading
    assert run_config(resumed, tmp_path / "old" / "step-2").data.train_files == [TRAIN]


def test_a_checkpoint_records_the_directory_its_config_was_read_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coati_kto.trainer.run_state import run_state

    monkeypatch.chdir(tmp_path)
    trainer = SimpleNamespace(
        position=SimpleNamespace(state=lambda loader, epoch: {"epoch": epoch}),
        _train_loader=None,
        layout=SimpleNamespace(dp_rank=0),
        global_step=3,
        skipped_steps=0,
        _interval=SimpleNamespace(state=lambda: None),
        _last_eval_step=None,
        _writer=None,
        run_config={"model": {}},
        optimizer=SimpleNamespace(param_groups=[{}]),
        data_stats=None,
    )
    assert run_state(trainer, 0)["config_cwd"] == str(tmp_path)
