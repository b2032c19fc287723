"""Gradient clipping on every plugin, and the gradient norm's non-finite vote, on 2 real gloo processes.

Clipping: with plain SGD (Adam would hide a gradient scale) one step under ``train.max_grad_norm`` c must move
the weights by the unclipped update times ``c / (norm + 1e-6)`` (torch.nn.utils.clip_grad_norm_), with the
global pre-clipping norm logged, on ddp, low_level_zero, hybrid zero 0 and tensor parallel 2 alike.
Non-finite: a NaN gradient under a finite loss on one rank (a hook on one parameter's gradient) under bf16 ZeRO.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import _build, _config, _global_steps, _weights, full_weights, sgd

from coati_kto.testing.distributed import run_distributed
from coati_kto.testing.tensorboard import read_scalars

LR = 0.5  # SGD step; the schedule has no warmup, so step 1 uses exactly this
CLIP_PLUGINS = {
    "ddp": {"name": "ddp", "zero_stage": 0, "precision": "fp32"},
    "low_level_zero": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "hybrid_zero0": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    "tp2": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
}
# bf16 gradients: the norm only (the clipped update is below bf16 weight resolution); zero 0 (AMP optimizer:
# fp32 masters in param_groups), zero 1 and 2 (partitions in different places of the ZeRO store).
BF16_NORM_PLUGINS = {
    "hybrid_zero0_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"},
    "hybrid_zero1_bf16": {"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}
BF16_PLUGINS = {
    "low_level_zero_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
}


def _one_step(model_dir: str, out_dir: str, plugin: dict, max_grad_norm: float) -> dict:
    """One SGD step on global micro-batches 0 and 1 of step 1 (one per dp rank, or both on each tp rank)."""
    import torch.distributed as dist

    step = _global_steps()[0][:2]
    tp = plugin.get("tp_size", 1) > 1
    cfg = _config(
        model_dir,
        out_dir,
        plugin=plugin,
        train={
            "lr": LR,
            "warmup_steps": 0,
            "max_grad_norm": max_grad_norm,
            "accumulation_steps": 2 if tp else 1,
        },
    )
    with sgd():
        parts, trainer = _build(cfg, total_steps=1)
    assert isinstance(parts.optimizer.optim, torch.optim.SGD)  # the patch reached the optimizer factory
    start = full_weights(parts.policy)
    trainer.fit(step if tp else step[dist.get_rank() : dist.get_rank() + 1])
    working = {p.untyped_storage().data_ptr() for p in parts.policy.unwrap().parameters()}
    stepped = [p for g in parts.optimizer.optim.param_groups for p in g["params"]]
    return {
        "update": full_weights(parts.policy) - start,
        "grad_norm": trainer.history[0]["train/grad_norm"],
        "own_storage": sum(p.untyped_storage().data_ptr() not in working for p in stepped) / len(stepped),
    }


def _clip_worker(model_dir: str, out_dir: str) -> dict:
    results = {}
    for name, plugin in CLIP_PLUGINS.items():
        free = _one_step(model_dir, out_dir, plugin, 0.0)
        clip = free["grad_norm"] / 20  # tiny: the clipped step is 1/20 of the free one
        results[name] = {"free": free, "clip": clip, "clipped": _one_step(model_dir, out_dir, plugin, clip)}
    for name, plugin in BF16_NORM_PLUGINS.items():
        results[name] = _one_step(model_dir, out_dir, plugin, 0.0)["grad_norm"]
    return results


def _nonfinite_worker(model_dir: str, out_dir: str, plugin: dict, on_nonfinite: str) -> dict:
    """3 steps, save every step; a NaN gradient on rank 1 only in step 2, under a finite loss."""
    import torch.distributed as dist

    from coati_kto.trainer.kto import NonFiniteLossError

    rank = dist.get_rank()
    out = Path(out_dir)
    cfg = _config(model_dir, out_dir, plugin=plugin, train={"max_grad_norm": 1.0})
    parts, trainer = _build(
        cfg, 3, save_dir=str(out / "checkpoints"), save_interval=1, keep_last=3, on_nonfinite=on_nonfinite
    )
    name, param = next((n, p) for n, p in parts.policy.unwrap().named_parameters() if "q_proj" in n)

    def poison(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if rank == 1 and trainer.global_step + 1 == 2 else grad

    param.register_hook(poison)
    error = None
    try:
        trainer.fit([step[rank] for step in _global_steps()], log_dir=str(out / "tensorboard"))
    except NonFiniteLossError as err:
        error = str(err)
    return {
        "error": error,
        "skipped": trainer.skipped_steps,
        "history": list(trainer.history),
        "weights": _weights(parts.policy),
        "poisoned": name,
    }


@pytest.fixture(scope="module")
def clip_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_clip_worker, 2, str(tiny_model_dir), str(tmp_path_factory.mktemp("clip")))


@pytest.mark.parametrize("plugin", list(CLIP_PLUGINS))
def test_max_grad_norm_clips_like_torch_on_every_plugin(clip_runs: list[dict], plugin: str) -> None:
    for result in clip_runs:
        run = result[plugin]
        free, clipped = run["free"]["update"], run["clipped"]["update"]
        norm = run["free"]["grad_norm"]
        # SGD: the free update is -LR * g, so its norm is LR times the logged global gradient norm.
        assert np.linalg.norm(free) == pytest.approx(LR * norm, rel=1e-5)
        assert run["clipped"]["grad_norm"] == pytest.approx(norm, rel=1e-6)  # pre-clipping norm is logged
        expected = free * (run["clip"] / (norm + 1e-6))
        # Updates are differences of fp32 weights (|w| < 1: rounding < 1e-7); not clipping would miss by 6e-3.
        assert np.abs(clipped - expected).max() <= 1e-6 < 0.1 * np.abs(free).max(), plugin
        # What the optimizer steps: the weights themselves, or (ZeRO, in fp32 too) copies coati-kto plan counts
        assert run["free"]["own_storage"] == (1.0 if plugin == "low_level_zero" else 0.0), plugin
    # Every plugin sees the same global gradient (same global batch): same norm, same update.
    reference = clip_runs[0]["ddp"]
    assert clip_runs[0][plugin]["free"]["grad_norm"] == pytest.approx(
        reference["free"]["grad_norm"], rel=1e-5
    )
    assert np.allclose(clip_runs[0][plugin]["clipped"]["update"], reference["clipped"]["update"], atol=1e-7)


@pytest.mark.parametrize("plugin", list(BF16_NORM_PLUGINS))
def test_bf16_zero_norm_is_the_global_norm(clip_runs: list[dict], plugin: str) -> None:
    expected = clip_runs[0]["ddp"]["free"]["grad_norm"]
    for result in clip_runs:  # every rank logs the same global norm, ddp's within bf16 gradient rounding
        assert result[plugin] == clip_runs[0][plugin]
        assert result[plugin] == pytest.approx(expected, rel=2e-2)


def _nonfinite_both(model_dir: str, out_dir: str, plugin: dict) -> dict:
    """The skip and the stop runs in one process set (each under its own directory)."""
    return {
        mode: _nonfinite_worker(model_dir, str(Path(out_dir) / mode), plugin, mode)
        for mode in ("skip", "stop")
    }


@pytest.fixture(scope="module", params=list(BF16_PLUGINS))
def nonfinite(request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp(request.param)
    runs = run_distributed(_nonfinite_both, 2, str(tiny_model_dir), str(out), BF16_PLUGINS[request.param])
    return {mode: ([r[mode] for r in runs], out / mode) for mode in ("skip", "stop")}


def _checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted((step_dir / "model").glob("*.safetensors")):
        tensors.update(load_file(file))
    for file in sorted((step_dir / "master_weights").glob("rank-*.pt")):
        tensors.update({f"{file.stem}/{k}": v for k, v in torch.load(file).items()})
    return tensors


def test_nan_gradient_under_finite_loss_is_skipped_everywhere(nonfinite: dict) -> None:
    results, tmp_path = nonfinite["skip"]
    for result in results:
        assert result["error"] is None and result["skipped"] == 1
        records = {int(h["step"]): h for h in result["history"] if "train/lr" in h}
        assert "train/loss" not in records[2] and "train/rewards/chosen" not in records[2]
        assert records[2]["train/skipped_steps"] == 1 and records[2]["train/skipped_in_interval"] == 1
        assert all(math.isfinite(v) for h in result["history"] for v in h.values())
        assert np.isfinite(result["weights"]).all()
    assert np.array_equal(results[0]["weights"], results[1]["weights"])

    # Nothing non-finite reached TensorBoard; the skipped step logged its count only.
    scalars = read_scalars(tmp_path / "tensorboard")
    assert all(math.isfinite(v) for series in scalars.values() for _, v in series)
    assert [s for s, _ in scalars["train/loss"]] == [1, 3]
    assert dict(scalars["train/skipped_steps"]) == {1: 0.0, 2: 1.0, 3: 1.0}

    # The skipped step changed nothing, and what it saved is finite (model and fp32 master shards).
    ckpt = tmp_path / "checkpoints"
    before, after = _checkpoint_tensors(ckpt / "step-1"), _checkpoint_tensors(ckpt / "step-2")
    assert before.keys() == after.keys() and any(k.startswith("rank-1/") for k in after)
    for key, value in after.items():
        assert torch.isfinite(value.float()).all(), key
        assert torch.equal(value, before[key]), key


def test_nan_gradient_with_stop_names_the_step_and_saves_nothing_bad(nonfinite: dict) -> None:
    results, tmp_path = nonfinite["stop"]
    for result in results:
        error = result["error"]
        assert error is not None and "\n" not in error
        assert "gradient norm at optimizer step 2" in error and "step-1" in error
        assert np.isfinite(result["weights"]).all()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir()) == ["step-1"]
    assert all(
        torch.isfinite(v.float()).all()
        for v in _checkpoint_tensors(tmp_path / "checkpoints" / "step-1").values()
    )
