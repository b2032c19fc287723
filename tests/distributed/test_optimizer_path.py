"""The project's gradient path after the backward (coati_kto.parallel.grad_norm, coati_kto.parallel.optimizer_path).

- The step's gradient norm (one fp32 ``_foreach_norm`` over the gradients, read with the step's sums) against a
  float64 norm of the whole averaged gradient, gathered independently (ZeRO partitions all-gathered, tensor-
  parallel slices all-gathered, replicas counted once), on every plugin, 2 real gloo processes.
- The work it does: a constant number of ops for the norm (was several per gradient), no multiply of the
  gradients when nothing is clipped or unscaled (was one per gradient: ``grad.mul_(1.0 / div_scale)``).
- ZeRO at one data-parallel rank: bit for bit the weights, fp32 masters and metrics of ColossalAI's bucket path,
  with fewer ops and none of the bucket's flatten (``cat``), division or all-gather.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_trainer import _build, _config, _global_steps, _rank_loader
from torch.utils._python_dispatch import TorchDispatchMode

from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "ddp_fp32": {"name": "ddp", "precision": "fp32"},
    "low_level_zero1_fp32": {"name": "low_level_zero", "zero_stage": 1, "precision": "fp32"},
    "low_level_zero2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "hybrid_zero0_fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    "hybrid_zero0_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"},
    "hybrid_zero1_bf16": {"name": "hybrid_parallel", "zero_stage": 1, "precision": "bf16"},
    "hybrid_zero2_bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "tp2_fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
}


class OpLog(TorchDispatchMode):
    """Every aten op that runs inside it: ``ops`` (name -> count) and ``grad_muls`` (multiplications whose
    target is one of ``grads``, by storage)."""

    def __init__(self, grads: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.grad_muls = 0
        self._grads = {g.untyped_storage().data_ptr() for g in grads}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in ("mul_", "_foreach_mul_"):
            targets = args[0] if isinstance(args[0], list | tuple) else [args[0]]
            self.grad_muls += sum(t.untyped_storage().data_ptr() in self._grads for t in targets)
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _reference_sq(policy: Any, optimizer: Any, layout: Any) -> float:
    """float64 sum of squares of the whole averaged gradient, gathered here; every rank calls (collectives)."""
    import torch.distributed as dist
    from colossalai.tensor.d_tensor import is_distributed_tensor
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    zero = isinstance(optimizer, LowLevelZeroOptimizer)
    total = 0.0
    for param in policy.unwrap().parameters():
        grad = optimizer.get_param_grad(param) if zero else param.grad  # ZeRO: its partitions all-gathered
        if grad is None:
            continue
        if layout.tp_size > 1 and is_distributed_tensor(param):
            slices = [torch.empty_like(grad) for _ in range(layout.tp_size)]
            dist.all_gather(slices, grad.contiguous(), group=layout.tp_group)
            grad = torch.cat([s.flatten() for s in slices])
        total += float(grad.detach().double().square().sum())
    return total


def _norm_worker(model_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    rank, results = dist.get_rank(), {}
    for name, plugin in PLUGINS.items():
        tp = plugin.get("tp_size", 1) > 1
        train = {"accumulation_steps": 2 if tp else 1, "max_grad_norm": 0.0}
        parts, trainer = _build(_config(model_dir, out_dir, plugin=plugin, train=train), total_steps=1)
        norm, seen = trainer._grad_norm, {}
        own = norm.local_share

        def recording(own=own, norm=norm, parts=parts, seen=seen) -> torch.Tensor:
            grads = [g for _, g in norm._param_grads()]
            with OpLog(grads) as ops:
                share = own()
            seen.update(ops=ops.total, grads=len(grads))
            seen["reference"] = math.sqrt(_reference_sq(parts.policy, parts.optimizer, parts.layout))
            step = norm.step

            def counted_step(value: float) -> None:
                with OpLog(grads) as step_ops:
                    step(value)
                seen["grad_muls"] = step_ops.grad_muls

            norm.step = counted_step
            return share

        norm.local_share = recording
        step = _global_steps()[0][:2]
        trainer.fit(step if tp else step[rank : rank + 1])
        results[name] = {**seen, "logged": trainer.history[0]["train/grad_norm"]}
    return results


@pytest.fixture(scope="module")
def norm_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(_norm_worker, 2, str(tiny_model_dir), str(tmp_path_factory.mktemp("norm")))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_grad_norm_is_the_float64_norm_of_the_whole_gradient(norm_runs: list[dict], plugin: str) -> None:
    for result in norm_runs:
        run = result[plugin]
        # fp32 accumulation of the same gradient values: within fp32 rounding (measured 5e-7 at most, ddp).
        assert run["logged"] == pytest.approx(run["reference"], rel=1e-6, abs=0), plugin
        assert run["logged"] == norm_runs[0][plugin]["logged"]  # one global value on every rank
    # Same global batch, same model: every plugin's norm is ddp's (tp2 would be off by its replicas if counted
    # twice), bf16 within bf16 gradient rounding.
    expected = norm_runs[0]["ddp_fp32"]["reference"]
    rel = 2e-2 if "bf16" in plugin else 1e-5
    assert norm_runs[0][plugin]["logged"] == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_grad_norm_and_unclipped_step_do_no_per_gradient_work(norm_runs: list[dict], plugin: str) -> None:
    for result in norm_runs:
        run = result[plugin]
        assert run["grads"] > 20  # the tiny Llama's gradients (or partitions)
        # _foreach_norm, stack, square, weights, sum (+ the tp all-reduce): was 4 ops per gradient.
        assert run["ops"] <= 8, run
        # max_grad_norm 0, no loss scale: the step multiplies no gradient (was one mul_ per gradient).
        assert run["grad_muls"] == 0, run


# ---------------------------------------------------------------- ZeRO at one data-parallel rank
SINGLE_RANK = {
    "ddp_fp32": {"name": "ddp", "precision": "fp32"},
    "low_level_zero1_bf16": {"name": "low_level_zero", "zero_stage": 1, "precision": "bf16"},
    "low_level_zero2_bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "low_level_zero2_fp32": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
    "hybrid_zero0_bf16": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "bf16"},
}


def _upstream_hybrid_configure() -> Any:
    """HybridParallelPlugin.configure as ColossalAI wrote it (upstream.fixes wraps it: DDP at one rank)."""
    from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin

    cells = [c.cell_contents for c in HybridParallelPlugin.configure.__closure__ or ()]
    return next(c for c in cells if getattr(c, "__name__", "") == "configure")


def _single_rank_run(model_dir: str, out_dir: str, plugin: dict, direct: bool) -> dict:
    """3 steps of 2 micro-batches (ZeRO-2 adds the second into its store) with clipping; ops of the third."""
    from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin

    from coati_kto.parallel import optimizer_path
    from coati_kto.parallel.masters import working_to_master
    from coati_kto.parallel.plan import ParallelPlan

    install, from_config = optimizer_path.install_single_rank_zero, ParallelPlan.from_config.__func__
    install_amp, configure = optimizer_path.install_mixed_precision_step, HybridParallelPlugin.configure
    if direct:  # what coati_kto.train builds: the plan knows the data-parallel size
        ParallelPlan.from_config = classmethod(lambda cls, config, dp_size=None: from_config(cls, config, 1))
    else:  # ColossalAI's own path: DDP's buckets, ZeRO's bucket reduction and all-gather write-back, the AMP
        # optimizer's per-parameter casts
        optimizer_path.install_single_rank_zero = lambda optimizer: False
        optimizer_path.install_mixed_precision_step = lambda optimizer: False
        HybridParallelPlugin.configure = _upstream_hybrid_configure()
    try:
        train = {"accumulation_steps": 2, "micro_batch_size": 4, "max_grad_norm": 0.05}
        parts, trainer = _build(_config(model_dir, out_dir, plugin=plugin, train=train), 3)
    finally:
        optimizer_path.install_single_rank_zero = install
        optimizer_path.install_mixed_precision_step = install_amp
        HybridParallelPlugin.configure = configure
        ParallelPlan.from_config = classmethod(from_config)
    batches = _rank_loader(1, 0)
    trainer._train_step(batches[0:2], 0)
    trainer._train_step(batches[2:4], 0)
    with OpLog() as ops:
        trainer._train_step(batches[4:6], 0)
    masters = working_to_master(parts.optimizer)
    params = list(parts.policy.unwrap().parameters())
    return {
        # numpy fp64 (exact for bf16 and fp32): crosses the result queue by value, not as a shared fd
        "weights": torch.cat([p.detach().double().flatten() for p in params]).numpy(),
        "masters": torch.cat([masters.get(id(p), p).detach().double().flatten() for p in params]).numpy(),
        "history": [{k: v for k, v in h.items() if "per_second" not in k} for h in trainer.history],
        "ops": dict(ops.ops),
        # ZeRO's or the AMP optimizer's step replaced, or no DDP wrapper
        "direct": type(parts.optimizer).step is not parts.optimizer.step.__func__
        or type(parts.policy.module).__name__ == "_Local",
    }


def _single_rank_worker(model_dir: str, out_dir: str) -> dict:
    return {
        name: {direct: _single_rank_run(model_dir, out_dir, plugin, direct) for direct in (False, True)}
        for name, plugin in SINGLE_RANK.items()
    }


@pytest.fixture(scope="module")
def single_rank_runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = str(tmp_path_factory.mktemp("single_rank"))
    return run_distributed(_single_rank_worker, 1, str(tiny_model_dir), out)[0]


@pytest.mark.parametrize("plugin", list(SINGLE_RANK))
def test_zero_at_one_rank_skips_the_buckets_bit_for_bit(single_rank_runs: dict, plugin: str) -> None:
    upstream, direct = single_rank_runs[plugin][False], single_rank_runs[plugin][True]
    assert direct["direct"] and not upstream["direct"]
    assert np.array_equal(upstream["weights"], direct["weights"])
    assert np.array_equal(upstream["masters"], direct["masters"])
    assert upstream["history"] == direct["history"]  # loss, rewards, the gradient norm: every logged number
    clipped = [h["train/grad_norm"] for h in direct["history"] if "train/grad_norm" in h]
    assert clipped and min(clipped) > 0.05  # clipping was active: its multiply is on both paths
    before, after = upstream["ops"], direct["ops"]
    assert sum(after.values()) < sum(before.values())
    if plugin.startswith("hybrid"):  # no DDP bucket (all-reduce); the AMP casts: two multi-tensor copies
        assert before.get("allreduce_", 0) >= 1 and after.get("allreduce_", 0) == 0, (before, after)
        assert before.get("_to_copy", 0) >= after.get("_to_copy", 0) + 20, (before, after)
        assert after["_foreach_copy_"] == 2 and after.get("copy_", 0) <= before.get("copy_", 0) - 20, (
            before,
            after,
        )
        return
    if plugin.startswith(
        "ddp"
    ):  # DDP's bucket: per gradient a multiply by 1 into it and a copy out; all-reduce
        assert before.get("allreduce_", 0) >= 1 and after.get("allreduce_", 0) == 0, (before, after)
        assert after.get("copy_", 0) <= before.get("copy_", 0) - 20 and after["mul"] <= before["mul"] - 20, (
            before,
            after,
        )
        return
    # The bucket's flatten (cat) and division by 1 are gone, so is the all-gather's flatten and copy back.
    assert before.get("cat", 0) >= 2 and after.get("cat", 0) < before["cat"], (before, after)
    assert before.get("div_", 0) >= 1 and after.get("div_", 0) == 0, (before, after)


FP16_PATHS = ("amp", "zero", "zero_one_rank")
TRUE_GRAD = (0.3, 0.0, 0.4)  # norm 0.5: under max_norm 1, nothing clipped


def _fp16_optimizer(path: str, weight: torch.nn.Parameter, scaling: dict) -> Any:
    """The fp16 optimizer class ``path``'s plugin builds, over SGD (lr 1) on ``weight``, clipping at norm 1."""
    from colossalai.amp.naive_amp.mixed_precision_optimizer import MixedPrecisionOptimizer
    from colossalai.zero.low_level.low_level_optim import LowLevelZeroOptimizer

    from coati_kto.parallel.optimizer_path import (
        install_clipping,
        install_mixed_precision_step,
        install_single_rank_zero,
    )

    sgd = torch.optim.SGD([weight], lr=1.0)
    if path == "amp":
        optimizer = MixedPrecisionOptimizer(sgd, precision="fp16", max_norm=1.0, **scaling)
        install_mixed_precision_step(optimizer)
    else:
        optimizer = LowLevelZeroOptimizer(sgd, clip_grad_norm=1.0, **scaling)
        if path == "zero_one_rank":
            assert install_single_rank_zero(optimizer)  # before the backward: it stores the gradients
    install_clipping(optimizer)
    return optimizer


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """The scaler counts devices; fp16 is GPU-only elsewhere."""
    from colossalai.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    counting = accelerator.device_count
    accelerator.device_count = lambda self: 1
    try:
        yield
    finally:
        accelerator.device_count = counting


def _fp16_overflow_steps(path: str) -> list[dict]:
    """Steps of an fp16 optimizer whose scaled gradient overflows, overflows again, then is clean: after each,
    whether ``skipped_by_loss_scaler`` says the scaler skipped it, the weight and the scale."""
    from coati_kto.parallel.loss_scale import loss_scale, skipped_by_loss_scaler
    from coati_kto.parallel.optimizer_path import given_norm

    out = []
    with _one_device():
        weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16))
        scaling = {"initial_scale": 2**10, "growth_interval": 1000, "hysteresis": 2}
        optimizer = _fp16_optimizer(path, weight, scaling)
        for grad in ((1e3, 0.0, 0.0), (1e3, 0.0, 0.0), TRUE_GRAD):  # 1e3 * 2**10 is past fp16's 65504
            optimizer.backward((weight.float() * torch.tensor(grad)).sum())
            scaled = float(torch.tensor(grad).norm()) * loss_scale(optimizer)
            with given_norm(optimizer, scaled if scaled < 65504 else float("inf")):
                optimizer.step()
            optimizer.zero_grad()
            out.append(
                {
                    "skipped": skipped_by_loss_scaler(optimizer),
                    "weight": weight.detach().float().tolist(),
                    "scale": loss_scale(optimizer),
                }
            )
    return out


@pytest.mark.parametrize("path", FP16_PATHS)
def test_a_step_the_fp16_loss_scaler_skips_is_known_as_skipped(path: str) -> None:
    """The trainer counts it in train/skipped_steps (before, such a step counted as taken): two overflows (the
    second backs the scale off, hysteresis 2), then a clean step that updates."""
    (steps,) = run_distributed(_fp16_overflow_steps, 1, path)
    assert [s["skipped"] for s in steps] == [True, True, False]
    assert steps[0]["weight"] == steps[1]["weight"] == [1.0, 2.0, 3.0]
    assert [s["scale"] for s in steps] == [2**10, 2**9, 2**9]
    assert steps[2]["weight"] == pytest.approx(
        [w - g for w, g in zip((1.0, 2.0, 3.0), TRUE_GRAD, strict=True)], abs=2e-3
    )


def _fp16_growth_step(path: str) -> dict:
    """One fp16 step whose scaler grows its scale (growth_interval 1) inside ``step``, on the optimizer classes
    the plugins build: the update must divide by the scale the gradients carry (2**10), not the grown one."""
    from coati_kto.parallel.optimizer_path import given_norm

    with _one_device():
        weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16))
        scaling = {"initial_scale": 2**10, "growth_interval": 1, "hysteresis": 2}
        optimizer = _fp16_optimizer(path, weight, scaling)
        true = torch.tensor(TRUE_GRAD)
        optimizer.backward((weight.float() * true).sum())  # the loss times the scale, 2**10
        with given_norm(optimizer, 0.5 * 2**10):
            optimizer.step()
        scale = float(
            optimizer.mixed_precision.loss_scale
            if path == "amp"
            else optimizer.mixed_precision_mixin.loss_scale
        )
        return {"weight": weight.detach().float().tolist(), "scale_after": scale}


@pytest.mark.parametrize("path", FP16_PATHS)
def test_fp16_step_that_grows_the_scale_unscales_by_the_gradients_own(path: str) -> None:
    (out,) = run_distributed(_fp16_growth_step, 1, path)
    assert out["scale_after"] == 2**11  # it grew inside the step
    # w - lr * g with the true gradient, to fp16 rounding (the grown scale gave w - g / 2: 0.85, 2.0, 2.8)
    expected = [w - g for w, g in zip((1.0, 2.0, 3.0), TRUE_GRAD, strict=True)]
    assert out["weight"] == pytest.approx(expected, abs=2e-3)
