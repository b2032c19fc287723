"""``coati-kto export`` with output.export_dtype fp32 of a bf16 checkpoint on another layout than it was saved on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import MINIMAL, write_config

from coati_kto.config.load import load_config
from coati_kto.errors import UserError


def _checkpoint(out: Path, world: int, tp: int, pp: int | None = None) -> Path:
    """A checkpoint whose files a resume reads are there (coati_kto.runtime.checkpoint_check), none of them real."""
    import torch

    step = out / "checkpoints" / "step-6"
    for folder in ("trainer_state", "model", "optimizer"):
        (step / folder).mkdir(parents=True)
    meta = {"step": 6, "world_size": world, "dp_size": world // tp // (pp or 1), "tp_size": tp}
    if pp is not None:
        meta |= {"sp_size": 1, "pp_size": pp}
    (step / "meta.json").write_text(json.dumps(meta))
    for rank in range(world):
        torch.save({"trainer_state": {}}, step / "trainer_state" / f"rank-{rank}.pt")
    torch.save({}, step / "lr_scheduler.pt")
    (step / "COMPLETE").write_text("step 6\n")
    return step


def test_fp32_masters_on_another_layout_are_refused_before_anything_heavy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The masters are per rank: on 1 process they were rebuilt from the bf16 weights, and the export (its card,
    its printed line) called bf16 weights cast to fp32 "the optimizer's fp32 master weights" (0.0037 off)."""
    from coati_kto.recipe.export import export_checkpoint

    out = tmp_path / "out"
    _checkpoint(out, world=2, tp=1)
    text = MINIMAL.replace("dir: out", f"dir: {out}\n  export_dtype: fp32") + "plugin:\n  precision: bf16\n"
    config = load_config(write_config(tmp_path, text))
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(UserError) as err:
        export_checkpoint(config)
    assert str(err.value) == (
        "coati-kto export: output.export_dtype fp32 writes the fp32 master weights, which step-6 holds per rank "
        "for 2 process(es) at plugin.tp_size 1, plugin.sp_size 1, plugin.pp_size 1, not 1 at 1, 1, 1 (they would "
        "be rebuilt from the bf16 weights): run it with --nproc-per-node 2 and plugin.tp_size=1 plugin.sp_size=1 "
        "plugin.pp_size=1, or output.export_dtype=training"
    )
    assert not (out / "exports" / "step-6").exists()


def test_fp32_masters_of_a_pipeline_checkpoint_on_the_same_process_count_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pp 2 saved, pp 1 exporting on the same 2 processes: the load rebuilt the masters (the layout differs) while
    this check compared only the process count and tp_size, and passed."""
    from coati_kto.recipe.export import export_checkpoint

    out = tmp_path / "out"
    _checkpoint(out, world=2, tp=1, pp=2)
    text = MINIMAL.replace("dir: out", f"dir: {out}\n  export_dtype: fp32") + "plugin:\n  precision: bf16\n"
    config = load_config(write_config(tmp_path, text))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match=r"plugin.pp_size 2, not 2 at 1, 1, 1 .* plugin.pp_size=2, or"):
        export_checkpoint(config)


def test_the_export_weighs_as_the_run_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With kto.auto_weights the weights depend on the number of data-parallel ranks: the card of a 1-process
    export of an 8-rank run gave lambda_D for 1 rank (0.2942 where the run trained with 0.2974). The run is set
    up with the checkpoint's dp size."""

    from coati_kto.recipe import export

    out = tmp_path / "out"
    _checkpoint(out, world=8, tp=1)
    config = load_config(write_config(tmp_path, MINIMAL.replace("dir: out", f"dir: {out}")))
    asked: list = []

    def setup_export(config: object, scratch: Path, trained_dp_size: int | None = None) -> None:
        asked.append(trained_dp_size)
        raise RuntimeError("stop here")

    monkeypatch.setattr(export, "setup_export", setup_export)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        export.export_checkpoint(config)
    assert asked == [8]


def test_the_export_prepares_data_in_a_folder_of_its_own_and_removes_only_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The export prepared the run's data (when data.prepared_dir held another build) in ``TARGET.prepared`` and
    deleted that path at the end, whatever it was: a folder of the user's there was lost."""
    from coati_kto.recipe import export

    out = tmp_path / "out"
    _checkpoint(out, world=1, tp=1)
    theirs = out / "exports" / "step-6.prepared"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    config = load_config(write_config(tmp_path, MINIMAL.replace("dir: out", f"dir: {out}")))
    made: list[Path] = []

    def setup_export(config: object, scratch, trained_dp_size: int | None = None) -> None:
        made.append(scratch())  # as global rank 0 does when data.prepared_dir holds another build
        (made[0] / "train").mkdir(parents=True)
        raise RuntimeError("stop here")

    monkeypatch.setattr(export, "setup_export", setup_export)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        export.export_checkpoint(config)
    assert made[0].parent.name.startswith(".step-6.coati-kto-data-") and not made[0].parent.exists()
    assert (theirs / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (out / "exports").iterdir()) == ["step-6.prepared"]


def test_a_run_saved_with_a_setting_now_refused_is_one_line(tmp_path: Path) -> None:
    """A run trained while a setting that did nothing was admitted (eval.samples without evaluation data, refused
    since): its saved config failed Config.model_validate inside export with a raw ValidationError."""
    import torch

    from coati_kto.recipe.export import run_config

    out = tmp_path / "out"
    step = _checkpoint(out, world=1, tp=1)
    config = load_config(write_config(tmp_path, MINIMAL.replace("dir: out", f"dir: {out}")))
    saved = config.model_dump(mode="json")
    saved["eval"]["samples"] = 4  # no eval data: refused at load today
    torch.save({"trainer_state": {"config": saved}}, step / "trainer_state" / "rank-0.pt")
    with pytest.raises(UserError) as err:
        run_config(config, step)
    assert str(err.value).startswith("checkpoint step-6: the config it was trained with no longer loads (")
    assert "(eval.samples 4 needs evaluation data: set data.eval_files" in str(err.value)
