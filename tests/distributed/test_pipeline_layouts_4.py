"""Pipeline parallelism on 4 gloo processes, hybrid ZeRO-1 bf16: pp 2 x dp 2 and tp 2 x pp 2, each against
tp 1 x dp 4 over the same global batches (test_layouts_4.py's steps and its bf16 bound).

3 SGD steps (lr 1, no clipping): the updates agree within bf16 rounding, the losses within 1e-2 relative and the
gradient norms within 2e-2, and every rank ends on the same full weights (each stage's merged over the pipeline
group, as the export merges them). Here the schedule's per-micro-batch loss division, the plugin's average over the
data-parallel group after the run, ZeRO-1's partitions per stage and the gradient norm's sum over the stages meet.
A pp 2 x dp 2 checkpoint resumes bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_layouts_4 import assert_layout_agrees
from test_trainer import _build, _config, _global_steps, _layout_config, sgd

from coati_kto.testing.distributed import run_distributed

STEPS = 3
ZERO1 = {"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"}
LAYOUTS = {"tp1_dp4": (1, 1), "pp2_dp2": (1, 2), "tp2_pp2": (2, 2)}  # name -> (tp_size, pp_size), 4 processes


def _full_weights(policy: Any, layout: Any) -> np.ndarray:
    """Every weight of the whole model, fp64, by name: tp slices gathered, pipeline stages merged."""
    import torch

    from coati_kto.trainer.export import merged_over_stages

    module = policy.unwrap()
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    if layout.pp_size > 1:
        state = merged_over_stages(state, module, layout.pp_group)
    return torch.cat([state[k].double().flatten() for k in sorted(state)]).numpy()


def _train(
    model_dir: str,
    ref_dir: str,
    out_dir: str,
    tp: int,
    pp: int,
    save: bool = False,
    resume: str | None = None,
) -> dict[str, Any]:
    """3 SGD steps of the global batches, 4 / dp micro-batches per rank per step; ``save``: a checkpoint after every
    step; ``resume``: from that checkpoint (the trainer skips the micro-batches consumed)."""
    import torch.distributed as dist

    dp = dist.get_world_size() // (tp * pp)
    base = _layout_config(model_dir, ref_dir, out_dir, 4 // dp)
    cfg = _config(
        model_dir,
        out_dir,
        model={**base.model.model_dump(), "attn_implementation": "sdpa"},
        data=base.data.model_dump(),
        plugin={**ZERO1, "tp_size": tp, "pp_size": pp},
        train={**base.train.model_dump(), "lr": 1.0, "warmup_steps": 0, "max_grad_norm": 0.0},
        kto=base.kto.model_dump(),
    )
    saving = {"save_dir": str(Path(out_dir) / "checkpoints"), "save_interval": 1, "keep_last": STEPS}
    with sgd():
        parts, trainer = _build(cfg, total_steps=STEPS, dp_size=dp, **(saving if save or resume else {}))
    layout = parts.layout
    start = _full_weights(parts.policy, layout)
    if resume:
        trainer.resume(resume)
    steps = _global_steps()[:STEPS]
    trainer.fit([mb for step in steps for mb in step[layout.dp_rank :: dp]])
    return {"start": start, "weights": _full_weights(parts.policy, layout), "history": trainer.history}


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model, ref = str(tiny_model_dir), str(reference_dir)
    out = {name: str(tmp_path_factory.mktemp(name)) for name in LAYOUTS}
    runs = {
        name: run_distributed(_train, 4, model, ref, out[name], tp, pp, name == "pp2_dp2")
        for name, (tp, pp) in LAYOUTS.items()
    }
    step1 = str(Path(out["pp2_dp2"]) / "checkpoints" / "step-1")
    resumed = str(tmp_path_factory.mktemp("pp2_dp2_resumed"))
    runs["pp2_dp2_resumed"] = run_distributed(_train, 4, model, ref, resumed, 1, 2, False, step1)
    return runs


@pytest.mark.parametrize("name", ["pp2_dp2", "tp2_pp2"])
def test_pipeline_layouts_agree_with_tp1_dp4_within_bf16(runs: dict[str, Any], name: str) -> None:
    assert_layout_agrees(runs, name, "tp1_dp4", STEPS)


def test_pp2_dp2_resume_is_bit_exact(runs: dict[str, Any]) -> None:
    """ZeRO-1's per-stage optimizer partitions, each rank's fp32 masters and the data position restore exactly."""
    whole, resumed = runs["pp2_dp2"], runs["pp2_dp2_resumed"]
    losses = [
        {h["step"]: h["train/loss"] for h in r[0]["history"] if "train/loss" in h} for r in (whole, resumed)
    ]
    assert list(losses[1]) == [2, 3]  # only the steps after the checkpoint ran
    assert losses[1] == {step: losses[0][step] for step in (2, 3)}
    assert all(np.array_equal(r["weights"], whole[0]["weights"]) for r in resumed)
