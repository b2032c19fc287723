"""Layouts beyond two processes: tensor parallel 2 x data parallel 2 (4 gloo processes), hybrid ZeRO-2 bf16.

The same 3 SGD steps (global batch: 4 micro-batches of test_trainer's steps) on tp 2 x dp 2 (accumulation 2), on
tp 1 x dp 4 (accumulation 1) and on tp 2 x dp 1 (accumulation 4, 2 processes): the updates agree within bf16
rounding. Resume on tp 2 x dp 2: saved after step 1, resumed, it ends on the uninterrupted run's weights exactly
(across layouts the epoch is re-planned through MixedLabelBatchSampler: test_resume_layout.py). 4 processes on 2
cores: tiny model, 3 steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_trainer import _build, _config, _global_steps, _layout_config, full_weights, sgd

from coati_kto.testing.distributed import run_distributed

STEPS = 3
ZERO2 = {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}
LAYOUTS = {"tp2_dp2": (4, 2), "tp1_dp4": (4, 1), "tp2_dp1": (2, 2)}  # name -> (processes, tp_size)


def _train(
    model_dir: str, ref_dir: str, out_dir: str, tp: int, save: bool = False, resume: str | None = None
) -> dict[str, Any]:
    """3 SGD steps (lr 1, no clipping) of the global batches, 4 / dp micro-batches per rank per step; ``save``: a
    checkpoint after every step; ``resume``: from that checkpoint (the trainer skips the micro-batches consumed)."""
    import torch.distributed as dist

    dp = dist.get_world_size() // tp
    base = _layout_config(model_dir, ref_dir, out_dir, 4 // dp)
    cfg = _config(
        model_dir,
        out_dir,
        model=base.model.model_dump(),
        plugin={**ZERO2, "tp_size": tp},
        train={**base.train.model_dump(), "lr": 1.0, "warmup_steps": 0, "max_grad_norm": 0.0},
        kto=base.kto.model_dump(),
    )
    saving = {"save_dir": str(Path(out_dir) / "checkpoints"), "save_interval": 1, "keep_last": STEPS}
    with sgd():
        parts, trainer = _build(cfg, total_steps=STEPS, **(saving if save or resume else {}))
    start = full_weights(parts.policy)
    if resume:
        trainer.resume(resume)
    dp_rank = parts.layout.dp_rank
    trainer.fit([mb for step in _global_steps()[:STEPS] for mb in step[dp_rank::dp]])
    return {"start": start, "weights": full_weights(parts.policy), "history": trainer.history, "dp": dp}


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model, ref = str(tiny_model_dir), str(reference_dir)
    return {
        name: run_distributed(_train, world, model, ref, str(tmp_path_factory.mktemp(name)), tp)
        for name, (world, tp) in LAYOUTS.items()
    }


def _update(run: list[dict[str, Any]]) -> np.ndarray:
    return run[0]["weights"] - run[0]["start"]


def assert_bf16_updates_agree(run: list[dict[str, Any]], reference: list[dict[str, Any]], what: str) -> None:
    """``run``'s update (3 steps, every rank on the same full weights) equals ``reference``'s within bf16 rounding.

    bf16 weights: layouts sum in other orders, so an update may round to the neighbouring bf16 value: one spacing
    at the weight's magnitude (5e-4 at 0.1, 3.9e-3 for a norm's weight just under 1), for at most 0.1% of the
    weights past 2% of the update scale (a few rounding neighbours, not a different update)."""
    assert all(np.array_equal(r["weights"], run[0]["weights"]) for r in run), what
    want = _update(reference)
    scale = np.abs(want).max()
    start = reference[0]["start"]
    spacing = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(start), 2.0**-126))) - 7)
    diff = np.abs(_update(run) - want)
    over = int((diff > 0.02 * scale).sum())
    print(
        f"{what}: max update difference {diff.max():.3e} (update scale {scale:.3e}); "
        f"{over} of {diff.size} weights past 2% of it, each by at most one bf16 spacing"
    )
    assert over <= 1e-3 * diff.size, (what, over)
    assert (diff <= 0.02 * scale + spacing).all(), (what, diff.max(), scale)


def assert_layout_agrees(runs: dict[str, Any], name: str, reference: str, steps: int) -> None:
    """``runs[name]`` against ``runs[reference]``: updates within bf16 rounding, the ``steps`` losses within 1e-2
    relative and the gradient norms within 2e-2."""
    assert_bf16_updates_agree(runs[name], runs[reference], f"{name} vs {reference}")
    losses = {
        n: [h["train/loss"] for h in runs[n][0]["history"] if "train/loss" in h] for n in (name, reference)
    }
    assert len(losses[name]) == steps
    assert np.allclose(losses[name], losses[reference], rtol=1e-2), losses
    norms = {
        n: [h["train/grad_norm"] for h in runs[n][0]["history"] if "train/grad_norm" in h]
        for n in (name, reference)
    }
    assert np.allclose(norms[name], norms[reference], rtol=2e-2), norms


def test_layouts_agree_within_bf16(runs: dict[str, Any]) -> None:
    assert all(np.array_equal(r["weights"], runs["tp2_dp2"][0]["weights"]) for r in runs["tp2_dp2"])
    for name in ("tp1_dp4", "tp2_dp1"):
        assert_bf16_updates_agree(runs[name], runs["tp2_dp2"], f"{name} vs tp2_dp2")
    losses = {n: [h["train/loss"] for h in runs[n][0]["history"] if "train/loss" in h] for n in LAYOUTS}
    for name in ("tp1_dp4", "tp2_dp1"):
        assert np.allclose(losses[name], losses["tp2_dp2"], rtol=1e-2), losses


def test_resume_is_exact_on_tp2_dp2(tiny_model_dir: Path, reference_dir: Path, tmp_path: Path) -> None:
    model, ref = str(tiny_model_dir), str(reference_dir)
    full = run_distributed(_train, 4, model, ref, str(tmp_path / "full"), 2, True)
    saved = str(tmp_path / "full" / "checkpoints" / "step-1")
    resumed = run_distributed(_train, 4, model, ref, str(tmp_path / "resumed"), 2, False, saved)
    losses = [
        {h["step"]: h["train/loss"] for h in r[0]["history"] if "train/loss" in h} for r in (full, resumed)
    ]
    assert list(losses[1]) == [2, 3]  # only the steps after the checkpoint ran
    assert losses[1] == {step: losses[0][step] for step in (2, 3)}
    assert all(np.array_equal(r["weights"], full[0]["weights"]) for r in resumed)
