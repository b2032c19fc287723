"""``train.fused_optimizer``: the one-pass mixed-precision AdamW (coati_kto.parallel.mixed_adamw) on real gloo ranks.

- Each step, on every plugin path it runs (ZeRO-2 and ZeRO-1 over 2 data-parallel ranks, ZeRO-2 at one rank, the
  AMP optimizer of hybrid ZeRO-0), equals torch's single-tensor AdamW replayed on copies of the same fp32 masters
  with the same bf16 gradients, clipping coefficient and scheduled lr, within fp32 rounding; the working weights
  are the masters rounded to bf16; the first step's rewards and KL are exactly 0.
- What a step costs (coati_kto.testing.kernels): one optimizer kernel, 28 bytes per parameter, one host sync.
- Checkpoints: a resumed fused run is bit-identical to the uninterrupted one, and fused and unfused runs load
  each other's checkpoints into the same optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_checkpoint import BF16, _setup, _snapshot, _train
from test_fused_optimizer import reference_adamw
from test_trainer import _build, _config, _rank_loader

from coati_kto.testing.distributed import run_distributed

pytestmark = pytest.mark.compile  # inductor builds the step's C++ kernels
PLUGINS = {  # name -> (plugin section, data-parallel size)
    "hybrid_zero2_dp2": ({"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"}, 2),
    "low_level_zero2_dp2": ({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, 2),
    "hybrid_zero1_dp2": ({"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"}, 2),
    "low_level_zero2_dp1": ({"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"}, 1),
    "hybrid_zero0_dp1": ({"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"}, 1),
}
STEP_ONE = ("train/rewards/chosen", "train/rewards/rejected", "train/kl", "train/rewards/margins")
MAX_NORM = 0.05  # below the tiny Llama's gradient norms: every step clips


class MixedReplay:
    """Wraps a ``MixedAdamW``'s ``step``: the masters, their working-dtype gradients and the clip coefficient it is
    handed go through torch's single-tensor AdamW on fp32 copies; after each step the largest difference from the
    copies (relative to the largest copy) and whether each written working tensor is its master in bf16."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.real_step = inner, inner.step
        self.copies: dict[int, torch.Tensor] = {}
        self.first: dict[int, torch.Tensor] = {}
        self.reference: torch.optim.Optimizer | None = None
        self.diffs: list[float] = []
        self.rounded: list[bool] = []
        self.groups: list[float] = []  # each parameter group's weight decay
        inner.step = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert self.inner._pending is not None  # the plugin's step took the mixed path
        updates, coef = self.inner._pending
        groups = self.inner.param_groups
        masters = [p for g in groups for p in g["params"] if id(p) in updates]
        if self.reference is None:
            self.copies = {id(m): m.detach().clone() for m in masters}
            self.first = {k: c.clone() for k, c in self.copies.items()}
            self.reference = reference_adamw(groups, self.copies)
            self.groups = [g["weight_decay"] for g in groups]
        for m in masters:
            self.copies[id(m)].grad = updates[id(m)][0].detach().view_as(m).float() * coef
        for ours, theirs in zip(groups, self.reference.param_groups, strict=True):
            theirs["lr"] = ours["lr"]
        out = self.real_step(*args, **kwargs)
        self.reference.step()
        scale = max(float(c.abs().max()) for c in self.copies.values())
        self.diffs.append(max(float((m - self.copies[id(m)]).abs().max()) for m in masters) / scale)
        self.rounded.append(all(torch.equal(updates[id(m)][1].view_as(m), m.bfloat16()) for m in masters))
        return out


def _replay_worker(model_dir: str, out_dir: str, dp: int) -> dict:
    import torch.distributed as dist

    from coati_kto.parallel.masters import gathered_masters

    results = {}
    for name, (plugin, size) in PLUGINS.items():
        if size != dp:
            continue
        train = {"accumulation_steps": 4 // dp, "max_grad_norm": MAX_NORM, "weight_decay": 0.1}
        cfg = _config(model_dir, f"{out_dir}/{name}", plugin=plugin, train={**train, "fused_optimizer": True})
        parts, trainer = _build(cfg, total_steps=3)
        replay = MixedReplay(parts.optimizer.optim)
        trainer.fit(_rank_loader(dp, dist.get_rank() % dp))
        masters = gathered_masters(parts.policy, parts.optimizer)
        working = dict(parts.policy.unwrap().named_parameters())
        results[name] = {
            "diffs": replay.diffs,
            "rounded": replay.rounded,
            "groups": replay.groups,
            "gathered": all(torch.equal(working[n].detach(), m.bfloat16()) for n, m in masters.items()),
            "moved": max(float((c - replay.first[k]).abs().max()) for k, c in replay.copies.items()),
            "norms": [h["train/grad_norm"] for h in trainer.history if "train/grad_norm" in h],
            "step1": {
                k: v for k, v in next(h for h in trainer.history if "train/kl" in h).items() if k in STEP_ONE
            },
        }
    return results


def _worker(model_dir: str, out_dir: str, dp: int) -> dict:
    """One process group for every scenario of its size (a spawn and the imports cost seconds)."""
    out = _replay_worker(model_dir, out_dir, dp)
    if dp == 1:
        out["counted"] = _counted_worker(model_dir, out_dir)
    else:
        out["checkpoints"] = _checkpoint_worker(model_dir, out_dir)
    return out


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = str(tmp_path_factory.mktemp("mixed"))
    two = run_distributed(_worker, 2, str(tiny_model_dir), root + "/2", 2)
    one = run_distributed(_worker, 1, str(tiny_model_dir), root + "/1", 1)
    out = {name: [r[name] for r in (two if size == 2 else one)] for name, (_, size) in PLUGINS.items()}
    return {**out, "counted": one[0]["counted"], "checkpoints": [r["checkpoints"] for r in two]}


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_mixed_step_is_torch_adamw_within_fp32_rounding(runs: dict, plugin: str) -> None:
    for run in runs[plugin]:
        assert len(run["diffs"]) == 3 and len(run["norms"]) == 3
        assert min(run["norms"]) > MAX_NORM  # clipping was active on every step (its coefficient folded in)
        assert run["moved"] > 1e-3  # the comparison is not vacuous
        assert max(run["diffs"]) < 1e-6, run["diffs"]  # a few ulps of the largest master
        assert all(run["rounded"]) and run["gathered"]  # working weights = masters in bf16, on every rank
        assert run["step1"] == dict.fromkeys(STEP_ONE, 0.0)  # the reference = the policy before any update
        assert run["groups"] == [0.1, 0.0]  # the norm weights step undecayed, in a group of their own


def _counted_worker(model_dir: str, out_dir: str) -> dict:
    from coati_kto.testing.kernels import KernelCounter

    out = {}
    for name in ("hybrid_zero0_dp1", "low_level_zero2_dp1"):
        train = {"accumulation_steps": 1, "max_grad_norm": 0.0, "fused_optimizer": True}
        cfg = _config(model_dir, f"{out_dir}/{name}", plugin=PLUGINS[name][0], train=train)
        parts, trainer = _build(cfg, total_steps=3)
        params = sum(p.numel() for p in parts.policy.unwrap().parameters())
        with KernelCounter(steps=True) as counter:
            trainer.fit(_rank_loader(1, 0)[:3])
        out[name] = [w.summary(params) for w in counter.windows[:-1]]
    return out


def test_mixed_step_costs_one_kernel_and_28_bytes(runs: dict) -> None:
    """Before (train.fused_optimizer false, tests/distributed/test_fused_optimizer.py): 4 optimizer kernels and
    40 bytes per parameter (two casts around torch's fused kernel)."""
    for name, windows in runs["counted"].items():
        assert len(windows) == 2, name
        for window in windows:
            cats = window["categories"]
            assert cats["optimizer"]["kernels"] <= 2, (name, cats["optimizer"])  # C++: 1 or 2 kernels
            assert cats["optimizer"]["bytes_per_param"] == pytest.approx(28.0, abs=0.1), name
            assert window["grad_path_bytes_per_param"] == pytest.approx(30.0, abs=0.1), name
            assert window["syncs"] == 1, (name, window["syncs_by_place"])


def _states(s: dict[str, Any]) -> list[np.ndarray]:
    inner = s["opt"].optim
    params = [p for g in inner.param_groups for p in g["params"]]
    return [inner.state[p][k].detach().cpu().numpy().copy() for p in params for k in sorted(inner.state[p])]


def _checkpoint_worker(model_dir: str, base: str) -> dict:
    """Fused and unfused: 2 steps, save, 2 steps; then each kind resumed from its own and the other's step 2."""
    from coati_kto.trainer.checkpoint import CheckpointManager

    out: dict[str, Any] = {}
    for kind, mixed in (("fused", True), ("unfused", False)):
        s = _setup(model_dir, BF16, f"{base}/{kind}", mixed_step=mixed)
        _train(s, 2)
        s["mgr"].save(2, s["model"], s["opt"], s["sched"], {"global_step": 2})
        _train(s, 2)
        out[kind] = _snapshot(s)
    for kind, mixed in (("fused", True), ("unfused", False)):
        for source in ("fused", "unfused"):
            s = _setup(model_dir, BF16, f"{base}/{kind}-from-{source}", mixed_step=mixed)
            path = CheckpointManager(f"{base}/{source}", s["booster"], s["layout"]).resolve("auto")
            s["mgr"].load(path, s["model"], s["opt"], s["sched"])
            out[f"{kind}<-{source} states"] = _states(s)
            if kind == "fused":  # continues from its own checkpoint, and steps on a state it did not create
                _train(s, 2)
                out[f"{kind}<-{source}"] = _snapshot(s)
    return out


def test_fused_checkpoints_resume_exactly_and_load_both_ways(runs: dict) -> None:
    for run in runs["checkpoints"]:
        ref, resumed = run["fused"], run["fused<-fused"]
        assert resumed["lr"] == ref["lr"] and len(ref["masters"]) > 0
        for name, w in ref["weights"].items():
            assert np.array_equal(w, resumed["weights"][name]), name
        for name, m in ref["masters"].items():
            assert np.array_equal(m, resumed["masters"][name]), name
        for source in ("fused", "unfused"):  # the same state whichever optimizer loads it
            mine, other = run[f"fused<-{source} states"], run[f"unfused<-{source} states"]
            assert len(mine) == len(other) > 0
            for a, b in zip(mine, other, strict=True):
                assert a.dtype == b.dtype and np.array_equal(a, b)
        assert ref["moments"] == run["unfused"]["moments"] == {"torch.float32"}
        assert all(np.isfinite(w).all() for w in run["fused<-unfused"]["weights"].values())
