"""Sequence parallelism (plugin.sp_size 2, all_to_all) through the whole ``coati-kto train`` recipe on 2 gloo
processes, against the same run at sp_size 1 on one process (fp32, ZeRO 0, SGD: a wrong gradient scale shows
in the weights, where Adam would divide it out).

Both runs read the same micro-batches (sp peers share the data-parallel rank, and dp is 1 in both), so after 3
steps the weights agree within fp32 summation order (the issue's bound: 2e-5 of each tensor's update), every
logged train/ and eval/ metric agrees within 1e-5 relative, and the online reference gives rewards and KL of
exactly 0 at step 1. A checkpoint taken at sp 2 resumes at sp 2 bit for bit, and at sp 1 within the same bound.
The same holds with activation checkpointing, with the cached reference and for LoRA's adapters. One module
fixture, nine launches
of a few seconds each (the suite's time budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import preference_records
from safetensors.torch import load_file
from same_seed_runs import (
    STEPS,
    UPDATE_BOUND,
    assert_same_metrics,
    assert_step1_rewards_and_kl_zero,
    sgd_train,
)
from same_seed_runs import final_weights as _weights
from same_seed_runs import update_error as _update_error

from coati_kto.data.files import write_jsonl
from coati_kto.testing.cli import run_cli


def _config(
    root: Path,
    model_dir: Path,
    sp: int,
    out: str,
    model: dict | None = None,
    kto: dict | None = None,
    **train: Any,
) -> Path:
    config = {
        "model": {"path": str(model_dir), "attn_implementation": "sdpa", **(model or {})},
        "data": {
            "train_files": [str(write_jsonl(preference_records(24, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(preference_records(6, 50), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 48,
            "padding_free": True,
        },
        "kto": {"beta": 0.5, **(kto or {})},
        "train": {
            "seed": 3,
            "micro_batch_size": 4,
            "accumulation_steps": 2,
            "max_steps": STEPS,
            "lr": 1.0,
            "warmup_steps": 0,
            "max_grad_norm": 0.0,
            "eval_interval": 2,
            **train,
        },
        "plugin": {"name": "hybrid_parallel", "precision": "fp32", "zero_stage": 0, "sp_size": sp},
        "output": {"dir": str(root / out), "save_interval": 1, "keep_last": STEPS},
    }
    path = root / f"{out}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _train(config: Path, world: int) -> None:
    proc = run_cli(["train", str(config)], world, command=sgd_train)
    assert proc.returncode == 0, proc.ranks[0].stdout[-3000:] + proc.ranks[0].stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sp_train")
    _train(_config(root, tiny_model_dir, 1, "sp1"), 1)
    _train(_config(root, tiny_model_dir, 2, "sp2"), 2)
    step1 = str(root / "sp2" / "checkpoints" / "step-1")
    _train(_config(root, tiny_model_dir, 2, "sp2_resumed", resume=step1), 2)
    _train(_config(root, tiny_model_dir, 1, "sp1_from_sp2", resume=step1), 1)
    checkpointing = {"gradient_checkpointing": True}
    _train(_config(root, tiny_model_dir, 2, "sp2_checkpointing", model=checkpointing), 2)
    cached = {"reference": "cached"}  # the first run scores the cache (whole rows), the second reads it
    _train(_config(root, tiny_model_dir, 1, "sp1_cached", kto=cached), 1)
    _train(_config(root, tiny_model_dir, 2, "sp2_cached", kto=cached), 2)
    lora = {"lora": {"rank": 4}}  # the online reference is the policy with its adapters off
    _train(_config(root, tiny_model_dir, 1, "sp1_lora", model=lora), 1)
    _train(_config(root, tiny_model_dir, 2, "sp2_lora", model=lora), 2)
    # `coati-kto export` of the sp 2 run's last checkpoint on one process (its own layout: sp_size 1)
    export = run_cli(["export", str(root / "sp2.yaml"), "plugin.sp_size=1", "--out", str(root / "sp_export")])
    assert export.returncode == 0, export.ranks[0].stderr[-3000:]
    return {path.name: path for path in root.iterdir() if path.is_dir() and path.name.startswith("sp")}


@pytest.mark.parametrize(
    "run, reference",
    [("sp2", "sp1"), ("sp2_checkpointing", "sp1"), ("sp2_cached", "sp1_cached")],
    ids=["online", "activation-checkpointing", "cached-reference"],
)
def test_sp2_weights_equal_sp1_within_fp32_rounding(
    runs: dict[str, Path], tiny_model_dir: Path, run: str, reference: str
) -> None:
    """Activation checkpointing recomputes through the wrapper; the cached reference's log-probs were scored on
    whole rows (``coati-kto precompute`` has no sp), the policy's at sp 2."""
    error = _update_error(runs[run], runs[reference], tiny_model_dir)
    assert error < UPDATE_BOUND, error


def test_sp2_logs_the_sp1_metrics(runs: dict[str, Path]) -> None:
    assert_same_metrics(runs["sp2"], runs["sp1"], {"train/loss", "train/grad_norm", "eval/loss", "train/kl"})


def test_sp2_step1_rewards_and_kl_are_exactly_zero(runs: dict[str, Path]) -> None:
    assert_step1_rewards_and_kl_zero(runs["sp2"])


def test_sp2_lora_adapters_equal_sp1(runs: dict[str, Path]) -> None:
    """LoRA at sp 2: the adapters (B starts at 0, so each is its own update) equal sp 1's within the bound."""
    path = Path("final") / "adapter" / "adapter_model.safetensors"
    got, want = load_file(runs["sp2_lora"] / path), load_file(runs["sp1_lora"] / path)
    assert len(want) == 16  # the default targets q, k, v, o (A and B each) of 2 layers
    scale = max(w.abs().max().item() for k, w in want.items() if "lora_B" in k)
    assert scale > 1e-3
    errors = {k: (got[k] - w).abs().max().item() / w.abs().max().item() for k, w in want.items()}
    assert max(errors.values()) < UPDATE_BOUND, errors


def test_an_sp2_checkpoint_exports_on_one_process_as_the_run_saved_it(runs: dict[str, Path]) -> None:
    exported = load_file(runs["sp_export"] / "model.safetensors")
    final = _weights(runs["sp2"])
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_sp2_resume_is_bit_exact(runs: dict[str, Path]) -> None:
    resumed, whole = _weights(runs["sp2_resumed"]), _weights(runs["sp2"])
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)


def test_sp2_checkpoint_resumes_at_sp1(runs: dict[str, Path], tiny_model_dir: Path) -> None:
    error = _update_error(runs["sp1_from_sp2"], runs["sp1"], tiny_model_dir)
    assert error < UPDATE_BOUND, error
