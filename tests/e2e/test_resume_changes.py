"""A resume with a changed config (issue 17): changed settings are named in one line and applied (a new
train.lr becomes the schedule's peak, as config.yaml and the model card say); settings that would make the
checkpoint another run's are refused in one line each, exit 2, nothing trained."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import preference_records

from coati_kto.data.formats import write_jsonl
from coati_kto.testing.tensorboard import read_scalars
from coati_kto.trainer.schedule import lr_factor

WARMUP, MIN_LR_RATIO = 1, 0.1


def _train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "coati_kto", "train", str(config), *overrides]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def first_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("resume_changes")
    config = {
        "model": {"path": str(tiny_model_dir)},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), root / "train.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
        },
        "train": {
            "micro_batch_size": 4,
            "max_steps": 4,
            "lr": 1e-3,
            "warmup_steps": WARMUP,
            "min_lr_ratio": MIN_LR_RATIO,
        },
        "plugin": {"name": "ddp", "precision": "fp32"},
        "output": {"dir": str(root / "out"), "save_interval": 2},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    done = _train(path)
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_changed_lr_is_applied_named_and_recorded(first_run: Path) -> None:
    done = _train(first_run, "train.resume=auto", "train.max_steps=6", "train.lr=5e-4")
    assert done.returncode == 0, done.stderr[-3000:]
    line = (
        "resume: 2 setting(s) differ from step-4's config, applied: train.lr 0.001 -> 0.0005, "
        "train.max_steps 4 -> 6"
    )
    assert line in done.stdout.splitlines()
    out = first_run.parent / "out"
    lrs = dict(read_scalars(out / "tensorboard")["train/lr"])
    # Steps 1-4 at the old peak over 4 steps; steps 5-6 at the new peak over the new length (6 steps).
    assert lrs[4] == pytest.approx(1e-3 * lr_factor(3, WARMUP, 4, MIN_LR_RATIO), rel=1e-6)
    assert lrs[5] == pytest.approx(5e-4 * lr_factor(4, WARMUP, 6, MIN_LR_RATIO), rel=1e-6)
    assert lrs[6] == pytest.approx(5e-4 * lr_factor(5, WARMUP, 6, MIN_LR_RATIO), rel=1e-6)
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["lr"] == 5e-4
    assert f"- {line}" in (out / "final" / "README.md").read_text()


def test_a_change_that_makes_another_run_is_refused(first_run: Path) -> None:
    out = first_run.parent / "out"
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    done = _train(first_run, "train.resume=auto", "train.seed=3", "train.max_steps=8")
    assert done.returncode == 2, done.stderr[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors == [
        f"error: train.resume {latest}: train.seed 42 -> 3: cannot change on resume (the data order of the "
        "epoch in progress depends on it)",
        "(start a new run in another output.dir, or resume unchanged)",
    ]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before  # nothing trained, nothing saved
