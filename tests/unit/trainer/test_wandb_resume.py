"""A resumed run goes on in the W&B run its output directory's earlier run started (each resume opened a new W&B
run, splitting every curve across runs while TensorBoard's went on in one directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coati_kto.trainer.logging import WANDB_RUN_ID, MetricWriter

pytest.importorskip("wandb")


def _run_id(out: Path, resume: bool, step: int) -> str:
    """A W&B offline run under ``out`` (as a training run's main rank starts it), one metric at ``step``."""
    settings = {"project": "coati-kto-test", "mode": "offline", "dir": out, "resume": resume}
    writer = MetricWriter(True, wandb_settings=settings)
    try:
        writer.log({"train/loss": 0.5}, step)
        return writer._wandb.id
    finally:
        writer.close()


def test_a_resume_goes_on_in_the_earlier_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = _run_id(tmp_path, resume=False, step=1)
    assert (tmp_path / WANDB_RUN_ID).read_text() == first + "\n"
    assert _run_id(tmp_path, resume=True, step=2) == first  # the same run, its steps going on
    # both offline runs' directories hold that id: `wandb sync` uploads them into one run
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{first}"))) == 2
    fresh = _run_id(tmp_path, resume=False, step=1)  # a new run (not a resume) is a new W&B run
    assert fresh != first and (tmp_path / WANDB_RUN_ID).read_text() == fresh + "\n"


def test_a_wandb_run_id_the_user_set_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With WANDB_RUN_ID set (read by wandb.init itself, once per process) no id is passed over it."""
    import types

    import wandb

    asked: list[dict] = []

    def init(**kwargs):
        asked.append(kwargs)
        return types.SimpleNamespace(id="chosen1", log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setattr(wandb, "init", init)
    (tmp_path / WANDB_RUN_ID).parent.mkdir()
    (tmp_path / WANDB_RUN_ID).write_text("earlier1\n")
    monkeypatch.setenv("WANDB_RUN_ID", "chosen1")
    assert _run_id(tmp_path, resume=True, step=2) == "chosen1"
    monkeypatch.delenv("WANDB_RUN_ID")
    _run_id(tmp_path, resume=True, step=3)
    assert [(a.get("id"), a.get("resume")) for a in asked] == [(None, None), ("chosen1", "allow")]
