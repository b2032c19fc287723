"""The default optimizer, torch's fused AdamW (coati_kto.parallel.optimizers.make_optimizer), and what its step costs.

- Against torch.optim.AdamW's single-tensor update on every plugin (2 real gloo processes): in a 3-step run with
  weight decay and clipping active, each step's optimizer inputs (its fp32 parameters, i.e. the masters or their
  ZeRO partitions, their clipped gradients and the scheduled lr) are replayed through a single-tensor AdamW
  on copies; after every step the parameters agree within fp32 rounding.
- The cost of one optimizer step (coati_kto.testing.kernels, the tiny Llama on one process): kernels and bytes
  per parameter of the optimizer and the gradient path, per plugin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer import _build, _config, _rank_loader

from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "ddp_fp32": {"name": "ddp", "precision": "fp32"},
    "low_level_zero2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero0_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"},
    "hybrid_zero1_bf16": {"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "tp2_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16", "tp_size": 2},
    "tp2_fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
}
MAX_NORM = 0.05  # below the tiny Llama's gradient norms: every step clips


def reference_adamw(groups: list[dict[str, Any]], copies: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """torch's single-tensor AdamW over ``copies`` (id(parameter) -> its copy) of the parameters in ``groups``
    that have one, group by group with each group's lr, betas, eps and weight decay (biases and norm weights sit
    in a group at weight decay 0: coati_kto.parallel.optimizers.parameter_groups)."""
    keys = ("lr", "betas", "eps", "weight_decay")
    ours = [{"params": [copies[id(p)] for p in g["params"] if id(p) in copies], **{k: g[k] for k in keys}}
            for g in groups]  # fmt: skip
    assert sum(len(g["params"]) for g in ours) == len(copies)
    return torch.optim.AdamW(ours, foreach=False)


class Replay:
    """Wraps a torch optimizer's ``step``: the same clipped gradients and lr go through a single-tensor AdamW on
    copies of its parameters (made at the first step), and after each step the largest difference between the
    parameters and their copies, relative to the largest copy, is recorded."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner, self.real_step = inner, inner.step
        self.copies: dict[int, torch.Tensor] = {}
        self.first: dict[int, torch.Tensor] = {}
        self.reference: torch.optim.Optimizer | None = None
        self.diffs: list[float] = []
        inner.step = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        groups = self.inner.param_groups
        params = [p for g in groups for p in g["params"] if p.grad is not None]
        if self.reference is None:
            self.copies = {id(p): p.detach().clone() for p in params}
            self.first = {id(p): p.detach().clone() for p in params}
            self.reference = reference_adamw(groups, self.copies)
        assert {id(p) for p in params} == set(self.copies)  # the same parameters step after step
        for p in params:
            self.copies[id(p)].grad = p.grad.detach().clone()
        for ours, theirs in zip(groups, self.reference.param_groups, strict=True):
            theirs["lr"] = ours["lr"]
        out = self.real_step(*args, **kwargs)
        self.reference.step()
        scale = max(float(c.abs().max()) for c in self.copies.values())
        self.diffs.append(max(float((p - self.copies[id(p)]).abs().max()) for p in params) / scale)
        return out

    def moved(self) -> float:
        """The largest change of a parameter since before the first step."""
        return max(float((c - self.first[k]).abs().max()) for k, c in self.copies.items())


def _replay_worker(model_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    rank, results = dist.get_rank(), {}
    for name, plugin in PLUGINS.items():
        dp = 1 if plugin.get("tp_size", 1) > 1 else 2
        train = {"accumulation_steps": 4 // dp, "max_grad_norm": MAX_NORM, "weight_decay": 0.1}
        parts, trainer = _build(_config(model_dir, out_dir, plugin=plugin, train=train), total_steps=3)
        inner = parts.optimizer.optim
        replay = Replay(inner)
        trainer.fit(_rank_loader(dp, rank % dp))
        results[name] = {
            "fused": inner.defaults.get("fused"),
            "diffs": replay.diffs,
            "moved": replay.moved(),
            "norms": [h["train/grad_norm"] for h in trainer.history if "train/grad_norm" in h],
        }
    return results


@pytest.fixture(scope="module")
def replays(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_replay_worker, 2, str(tiny_model_dir), str(tmp_path_factory.mktemp("fused")))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_fused_adamw_is_the_single_tensor_update_within_fp32_rounding(
    replays: list[dict], plugin: str
) -> None:
    for result in replays:
        run = result[plugin]
        assert run["fused"] is True
        assert len(run["diffs"]) == 3 and len(run["norms"]) == 3
        assert min(run["norms"]) > MAX_NORM  # clipping was active on every step
        assert run["moved"] > 1e-3  # 3 steps of lr ~1e-2 moved the parameters: the comparison is not vacuous
        # fp32 rounding of different operation orders, 3 steps: a few ulps of the largest parameter
        assert max(run["diffs"]) < 1e-6, run["diffs"]


# ------------------------------------------------------------------------------------------- the cost
COUNTED = {
    # name -> (plugin section, max_grad_norm, optimizer kernels, optimizer bytes/param, gradient norm bytes/param);
    # 0.05 clips every step (one more multi-tensor multiply, 8 bytes per parameter of fp32 gradients)
    "hybrid_zero2_bf16_clipped": ({"name": "hybrid_parallel", "precision": "bf16"}, MAX_NORM, 5, 48.0, 2.0),
    "hybrid_zero0_fp32": (
        {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
        0.0,
        2,
        28.0,
        4.0,
    ),
    "low_level_zero2_bf16": (
        {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
        0.0,
        4,
        40.0,
        2.0,
    ),
    "ddp_fp32_clipped": ({"name": "ddp", "precision": "fp32"}, MAX_NORM, 3, 36.0, 4.0),
}


def _counted_worker(root: str, model_dir: str) -> dict:
    """Each plugin of COUNTED: 3 steps of coati_kto.train.train under the kernel counter; the steady steps'
    per-category figures."""
    from coati_kto.config.schema import Config
    from coati_kto.data.files import write_jsonl
    from coati_kto.testing.kernels import KernelCounter
    from coati_kto.train import train

    records = [
        {"prompt": f"Question {i}?", "completion": "Yes." * (1 + i % 3), "label": i % 3 != 0}
        for i in range(24)
    ]
    write_jsonl(records, Path(root) / "train.jsonl")
    out = {}
    for name, (plugin, max_norm, *_) in COUNTED.items():
        raw = {
            "model": {"path": model_dir},
            "data": {"train_files": [f"{root}/train.jsonl"], "prepared_dir": f"{root}/prepared"},
            "train": {
                "micro_batch_size": 4,
                "accumulation_steps": 1,
                "max_steps": 3,
                "max_grad_norm": max_norm,
            },
            "plugin": plugin,
            "output": {"dir": f"{root}/out-{name}", "save_final": False},
            "logging": {"tensorboard": False},
        }
        with KernelCounter(steps=True) as counter:
            trainer = train(Config.model_validate(raw))
        params = sum(p.numel() for p in trainer.policy.unwrap().parameters())
        out[name] = [w.summary(params) for w in counter.windows[:-1]]
    return out


@pytest.fixture(scope="module")
def counted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("cost")
    return run_distributed(_counted_worker, 1, str(root), str(tiny_model_dir))[0]


@pytest.mark.parametrize("plugin", list(COUNTED))
def test_optimizer_step_costs_one_pass(counted: dict, plugin: str) -> None:
    """Per optimizer step: the fused AdamW kernel (28 bytes per parameter: the fp32 parameter and moments read and
    written, the gradient read) and the step counts' increment; with bf16 working weights the two multi-tensor
    casts (gradients to fp32, 6 bytes per parameter; masters into the working weights, 6); when clipping, the
    multiply. Before (torch's single-tensor AdamW on CPU, per-parameter casts, DDP's bucket at one rank), hybrid
    ZeRO-2 bf16 on one process: 232 kernels and 92 bytes per parameter in the optimizer, 25 and 8 in buckets."""
    _, _, kernels, optimizer_bytes, norm_bytes = COUNTED[plugin]
    windows = counted[plugin]
    assert len(windows) == 2
    for window in windows:
        cats = window["categories"]
        assert cats["optimizer"]["kernels"] == kernels, cats["optimizer"]
        assert cats["optimizer"]["bytes_per_param"] == pytest.approx(optimizer_bytes, abs=0.05)
        assert cats["gradient norm"]["bytes_per_param"] == pytest.approx(norm_bytes, abs=0.05)
        assert cats["gradient buckets and reductions"]["bytes_per_param"] < 0.05  # no bucket at one rank
        assert window["grad_path_bytes_per_param"] <= optimizer_bytes + norm_bytes + 0.05
        assert window["syncs"] == 1
