"""Resume across 4-process layouts, through the CLI as users launch it: tensor parallel 2 x data parallel 2 trains
to a checkpoint; tensor parallel 1 x data parallel 4 resumes from it and finishes the run (hybrid ZeRO-2 bf16).

The global batch is the same on both layouts (2 per micro-batch x accumulation 2 x dp 2 = 2 x 1 x 4 = 8), the
epoch's unconsumed examples are re-planned over the new ranks, and the run ends on the planned step with finite
metrics and weights that moved on from the checkpoint. (Same-layout resume at 4 processes is bit-exact:
tests/distributed/test_layouts_4.py.)
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch
from helpers import env, weights, write_run

from coati_kto.testing.cli import run_cli
from coati_kto.testing.tensorboard import read_scalars

STEPS, SAVE_AT = 6, 3


def _launch(config: Path, nproc: int, *overrides: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "coati_kto",
        "train",
        "--nproc-per-node",
        str(nproc),
        str(config),
        *overrides,
    ]
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout + done.stderr


def test_tp2_dp2_checkpoint_resumes_on_tp1_dp4(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = write_run(tmp_path, tiny_model_dir, steps=STEPS, save_interval=SAVE_AT)
    first = tmp_path / "tp2_dp2"
    # The run to the checkpoint is only the CLI's code path on 4 ranks: on worker ranks (coati_kto.testing.cli),
    # not 6 new processes' imports. The resume on the other layout, which must read everything from disk, is the
    # real 4-process launch.
    done = run_cli(
        ["train", str(config), "plugin.tp_size=2", "train.accumulation_steps=2", f"output.dir={first}"], 4
    )
    assert done.returncodes == [0] * 4, (done.stdout + done.stderr)[-3000:]
    checkpoint = first / "checkpoints" / f"step-{SAVE_AT}"
    assert (checkpoint / "COMPLETE").is_file(), sorted((first / "checkpoints").iterdir())

    second = tmp_path / "tp1_dp4"
    said = _launch(
        config,
        4,
        "plugin.tp_size=1",
        "train.accumulation_steps=1",
        f"output.dir={second}",
        f"train.resume={checkpoint}",
    )
    assert f"resumed from {checkpoint}" in said, said[-3000:]
    # Said once for the run, as a warning line (it was a logging record per rank: WARNING:coati_kto...:rank N).
    changed = [line for line in said.splitlines() if "layout changed" in line]
    assert changed == [
        "warning: the parallel layout changed since the save: RNG states not restored, fp32 master weights "
        "rebuilt from its weights"
    ], changed
    losses = dict(read_scalars(second / "tensorboard")["train/loss"])
    assert sorted(losses) == list(range(SAVE_AT + 1, STEPS + 1)), losses
    assert all(math.isfinite(v) for v in losses.values())
    resumed, uninterrupted = weights(second), weights(first)
    assert resumed.keys() == uninterrupted.keys()
    # Another layout re-plans the rest of the epoch (other micro-batches): close to the uninterrupted run, not equal.
    moved = max((resumed[k].float() - uninterrupted[k].float()).abs().max().item() for k in resumed)
    assert 0.0 < moved < 0.05, moved
    assert all(torch.isfinite(t.float()).all() for t in resumed.values())
