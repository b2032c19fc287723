"""Sequence parallelism on 4 gloo processes, hybrid ZeRO-2 bf16: sp 2 x dp 2 and tp 2 x sp 2 (all_to_all), each
against tp 1 x dp 4 over the same global batches (test_layouts_4.py's steps, as padding-free rows, each sp rank
fed its slice by ``slice_rows`` as the collator feeds it).

3 SGD steps (lr 1, no clipping): the updates agree within bf16 rounding (test_layouts_4.py's bound), the losses
within 1e-2 relative, and every rank ends on the same full weights. ZeRO shards over dp x sp here (ColossalAI's
mixed group), so this is where the gradient norm's sum over the sp group and the sp sum's gradient scale meet
ZeRO's reduce-scatter.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_layouts_4 import assert_layout_agrees
from test_trainer import _build, _config, _global_steps, _layout_config, full_weights, sgd

from coati_kto.testing.distributed import run_distributed

STEPS = 3
ZERO2 = {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}
LAYOUTS = {"tp1_dp4": (1, 1), "sp2_dp2": (1, 2), "tp2_sp2": (2, 2)}  # name -> (tp_size, sp_size), 4 processes


def _rows(batch: Any, sp: int, rank: int) -> Any:
    """``batch`` with its padding-free rows (one row per pass), sliced for sp rank ``rank`` when ``sp`` > 1."""
    from coati_kto.data.packed import plan_rows, slice_rows

    rows = [plan_rows(batch.example, None, "one"), plan_rows(None, batch.kl, "one")]
    if sp > 1:
        rows = [slice_rows(r, sp, rank) for r in rows]
    return replace(batch, example_rows=rows[0], kl_rows=rows[1])


def _train(model_dir: str, ref_dir: str, out_dir: str, tp: int, sp: int) -> dict[str, Any]:
    import torch.distributed as dist

    dp = dist.get_world_size() // (tp * sp)
    base = _layout_config(model_dir, ref_dir, out_dir, 4 // dp)
    cfg = _config(
        model_dir,
        out_dir,
        model={**base.model.model_dump(), "attn_implementation": "sdpa"},
        data={**base.data.model_dump(), "padding_free": True},
        plugin={**ZERO2, "tp_size": tp, "sp_size": sp},
        train={**base.train.model_dump(), "lr": 1.0, "warmup_steps": 0, "max_grad_norm": 0.0},
        kto=base.kto.model_dump(),
    )
    with sgd():
        parts, trainer = _build(cfg, total_steps=STEPS, dp_size=dist.get_world_size() // tp)
    start = full_weights(parts.policy)
    layout = parts.layout
    steps = _global_steps()[:STEPS]
    trainer.fit([_rows(mb, sp, layout.sp_rank) for step in steps for mb in step[layout.dp_rank :: dp]])
    return {"start": start, "weights": full_weights(parts.policy), "history": trainer.history}


@pytest.fixture(scope="module")
def runs(
    tiny_model_dir: Path, reference_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    model, ref = str(tiny_model_dir), str(reference_dir)
    return {
        name: run_distributed(_train, 4, model, ref, str(tmp_path_factory.mktemp(name)), tp, sp)
        for name, (tp, sp) in LAYOUTS.items()
    }


@pytest.mark.parametrize("name", ["sp2_dp2", "tp2_sp2"])
def test_sequence_parallel_layouts_agree_with_tp1_dp4_within_bf16(runs: dict[str, Any], name: str) -> None:
    assert_layout_agrees(runs, name, "tp1_dp4", STEPS)
