"""The README's one example, run as printed (its commands parsed from README.md, so the test follows the README)
in a copy of the clone's configs/ and applications/: the tiny model, prepare, inspect, then a 1-process train
whose logged loss must fall and margin rise at the configured learning rate (issue 50: the example it replaced
ran one step at 4.5e-8 and its loss stayed 0.5000)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import env

from coati_kto.testing.tensorboard import read_scalars

REPO = Path(__file__).resolve().parents[2]


def readme_example() -> list[str]:
    """The command lines of the first ```bash block under README.md's "## One example", comments stripped."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## One example\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "README.md's One example has no ```bash block"
    return [line.split("  #")[0].strip() for line in block[1].splitlines() if line.strip()]


def _run(argv: list[str], cwd: Path) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    return done.stdout


def _metric(scalars: dict, *names: str) -> list[float]:
    """The values of the first of ``names`` that was logged (TRL's name or this project's older one)."""
    found = [name for name in names if name in scalars]
    assert found, f"none of {names} logged; logged: {sorted(scalars)}"
    return [value for _, value in scalars[found[0]]]


def test_the_readme_example_learns_as_printed(tmp_path: Path) -> None:
    lines = [
        line for line in readme_example() if line != "source .venv/bin/activate"
    ]  # this interpreter's env
    *commands, board = lines
    logdir = shlex.split(board)
    assert Path(logdir[0]).name == "tensorboard" and logdir[1] == "--logdir", board  # a server: not run
    for name in ("configs", "applications"):  # what a fresh clone holds (no outputs/)
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    said = {}
    for line in commands:
        argv = shlex.split(line)
        assert Path(argv[0]).name == "coati-kto", f"README example line not run by this test: {line}"
        said[argv[1]] = _run([sys.executable, "-m", "coati_kto", *argv[1:]], tmp_path)
    assert list(said) == ["tiny-model", "prepare", "inspect", "train"]

    config = yaml.safe_load((tmp_path / shlex.split(commands[-1])[2]).read_text())
    scalars = read_scalars(tmp_path / logdir[2])
    loss = _metric(scalars, "train/loss")
    margin = _metric(scalars, "train/rewards/margins", "train/rewards/margin")
    lr = _metric(scalars, "train/lr")
    steps = len(loss)
    assert steps == 24 and len(margin) == steps  # 48 examples / micro-batch 4 x 2 epochs, all logged
    assert max(lr) == pytest.approx(config["train"]["lr"], rel=1e-6)  # the configured lr is reached (float32)
    assert config["train"]["lr"] == 1e-3
    assert "warning" not in said["train"]
    # Step 1 is the untrained policy (policy = reference): loss 0.5, margin 0. The last quarter must be far off.
    assert abs(loss[0] - 0.5) < 1e-6 and abs(margin[0]) < 1e-6
    last = steps // 4
    assert sum(loss[-last:]) / last < 0.40, loss
    assert sum(margin[-last:]) / last > 1.0, margin
    # Falling and rising over the run, not one lucky step: each quarter's mean beats the one before.
    quarters = [slice(q * last, (q + 1) * last) for q in range(4)]
    loss_q = [sum(loss[q]) / last for q in quarters]
    margin_q = [sum(margin[q]) / last for q in quarters]
    assert loss_q == sorted(loss_q, reverse=True) and margin_q == sorted(margin_q), (loss_q, margin_q)
    # train says how each epoch uses the data (here: every example).
    assert (
        "per epoch: 12 micro-batches per rank (1 rank x train.micro_batch_size 4), every one of the 48 train "
        "examples used" in said["train"].splitlines()
    )
