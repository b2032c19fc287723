"""A checkpoint saved without pipeline stages (pp 1), taken up at pp 2 on 2 gloo processes, tied 3-layer Llama.

Resume: a pp 1 checkpoint of a tied model stores the tie once (``model.embed_tokens.weight``; no ``lm_head.weight``
in its index). At pp 2 the last stage holds the head as ``lm_head.weight`` alone: it must be loaded from the
embedding's shard, or it keeps the base model's weights (0.85 of the update off after 2 more steps). The pp 2
resume of the pp 1 run's step-1 checkpoint equals the uninterrupted pp 1 run within the bound of
test_pipeline_train.py (2e-5 of each tensor's update; measured 7.5e-6, fp32 SGD); in bf16 (AdamW, the AMP
optimizer) the fp32 masters are rebuilt from the loaded weights, the head's included.

Export: a bf16 hybrid_parallel run at plugin.zero_stage 2 and train.accumulation_steps 1 exports at pp 2 with the
overrides the config load asks for, ``plugin.zero_stage=1`` (ColossalAI takes ZeRO 0 or 1 under pp) and
``train.accumulation_steps=2``: both now reach the export's run config (the saved config's stage used to win, and its
accumulation failed the schedule's rule, which an export that trains nothing need not meet). Its weights equal the
pp 1 export's bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from same_seed_runs import UPDATE_BOUND, final_weights, update_error
from test_pipeline_train import _config, _train, tied_model_dir  # noqa: F401 (a fixture)

from coati_kto.testing.cli import run_cli


@pytest.fixture(scope="module")
def runs(tied_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:  # noqa: F811
    root = tmp_path_factory.mktemp("pp_from_pp1")
    _train(_config(root, tied_model_dir, 1, "pp1"), 1)
    step1 = str(root / "pp1" / "checkpoints" / "step-1")
    _train(_config(root, tied_model_dir, 2, "pp2_from_pp1", train={"resume": step1}), 2)
    bf16 = {"precision": "bf16", "zero_stage": 2}
    train = {"accumulation_steps": 1, "max_steps": 2, "lr": 0.01}
    _train(_config(root, tied_model_dir, 1, "bf16", plugin=bf16, train=train), 1)
    amp = {
        "plugin": {"precision": "bf16"},
        "train": {"lr": 0.01},
    }  # AdamW (the CLI's), ZeRO 0: the AMP masters
    _adamw(_config(root, tied_model_dir, 1, "amp_pp1", **amp))
    amp_step1 = {"lr": 0.01, "resume": str(root / "amp_pp1" / "checkpoints" / "step-1")}
    _adamw(_config(root, tied_model_dir, 2, "amp_pp2_from_pp1", plugin=amp["plugin"], train=amp_step1), 2)
    return {"root": root, **{p.name: p for p in root.iterdir() if p.is_dir()}}


def _adamw(config: Path, world: int = 1) -> None:
    proc = run_cli(["train", str(config)], world)
    assert proc.returncode == 0, proc.ranks[-1].stderr[-3000:]


def test_the_pp1_checkpoint_stores_the_tie_once(runs: dict[str, Path]) -> None:
    index = runs["pp1"] / "checkpoints" / "step-1" / "model" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    assert "model.embed_tokens.weight" in weight_map and "lm_head.weight" not in weight_map


def test_a_tied_pp1_checkpoint_resumes_at_pp2(runs: dict[str, Path], tied_model_dir: Path) -> None:  # noqa: F811
    error = update_error(runs["pp2_from_pp1"], runs["pp1"], tied_model_dir)
    assert error < UPDATE_BOUND, error


def test_a_tied_bf16_pp1_checkpoint_resumes_at_pp2_with_its_masters(
    runs: dict[str, Path],
    tied_model_dir: Path,  # noqa: F811
) -> None:
    """bf16: the layout change rebuilds every fp32 master from its bf16 weight, the loaded head's included
    (``update_master_params``). The typical tensor's mean difference from the uninterrupted run, over its mean
    update after 3 steps: 1.4e-3 (without the masters' refresh 9.1e-3; without the head's load 0.17)."""
    init = load_file(tied_model_dir / "model.safetensors")
    got, want = final_weights(runs["amp_pp2_from_pp1"]), final_weights(runs["amp_pp1"])
    assert got.keys() == want.keys()
    errors = sorted(
        ((got[k].float() - w.float()).abs().mean() / (w.float() - init[k].float()).abs().mean()).item()
        for k, w in want.items()
    )
    assert errors[len(errors) // 2] < 4e-3, errors


def _export(runs: dict[str, Path], out: str, world: int, *overrides: str):
    config = runs["root"] / "bf16.yaml"
    target = runs["root"] / out
    return run_cli(["export", str(config), *overrides, "--out", str(target)], world), target


def test_a_pp1_bf16_zero2_checkpoint_exports_at_pp2_with_zero1(runs: dict[str, Path]) -> None:
    one, one_dir = _export(runs, "export_pp1", 1)
    assert one.returncode == 0, one.ranks[0].stderr[-3000:]
    fixes = ("plugin.zero_stage=1", "train.accumulation_steps=2")  # what the config load asks for at pp 2
    two, two_dir = _export(runs, "export_pp2", 2, "plugin.pp_size=2", *fixes)
    assert two.returncode == 0, two.ranks[0].stderr[-3000:]
    got, want = load_file(two_dir / "model.safetensors"), load_file(one_dir / "model.safetensors")
    assert got.keys() == want.keys() and "lm_head.weight" not in got
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)


def test_the_pp2_export_without_the_override_names_the_fix(runs: dict[str, Path]) -> None:
    proc, _ = _export(runs, "export_refused", 2, "plugin.pp_size=2", "train.accumulation_steps=2")
    assert proc.returncode == 2
    line = (
        "plugin.pp_size 2 with plugin.zero_stage 2: ColossalAI allows ZeRO stage 0 or 1 with pipeline "
        "parallelism (hybrid_parallel_plugin.py:1134): set plugin.zero_stage=1"
    )
    assert line in proc.ranks[0].stderr, proc.ranks[0].stderr[-3000:]
