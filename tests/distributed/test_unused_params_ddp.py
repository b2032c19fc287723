"""Torch DDP paths (ddp, hybrid_parallel ZeRO-0 fp32) at 2 data-parallel ranks with parameters the forward does not
use (2 gloo processes).

Cross-attention without an encoder and sparse indexers never get a gradient; an MoE expert gets one only on the
ranks and micro-batches that route a token to it. DDP built without ``find_unused_parameters`` failed the second
step ("Expected to have finished reduction in the prior iteration"). Here the training must equal, bit for bit,
one process doing DDP's arithmetic on both ranks' rows: the never-used parameter untouched (no gradient, so
AdamW neither decays it nor holds state for it), the one used late, on rank 0's first micro-batch only (under
``no_sync``), updated from its averaged gradient. hybrid also runs with non-reentrant activation checkpointing,
as ``train.py`` enables it (reentrant checkpointing re-runs the forward inside the backward, which DDP's
unused-parameter search cannot follow: "Expected to mark a variable ready only once").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coati_kto.testing.distributed import run_distributed

PLUGINS = {
    "ddp-fp32": ({"name": "ddp", "precision": "fp32"}, False),
    "hybrid-zero0-fp32-checkpointing": (
        {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
        True,
    ),
}
STEPS, ACCUMULATION, LATE_FROM = (
    4,
    2,
    3,
)  # ``late`` is used from step 3 on, on rank 0's first micro-batch only
LR, WEIGHT_DECAY = 3e-3, 0.01


def _model(model_dir: str, checkpointing: bool) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The tiny Llama with two extra 64 x 64 maps added to the final norm's output when switched on: ``never``
    (never on) and ``late`` (``use["late"]``)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hidden = model.config.hidden_size
    use = {"late": False}
    for seed, name in enumerate(("never", "late")):
        layer = torch.nn.Linear(hidden, hidden, bias=False)
        with torch.no_grad():
            layer.weight.copy_(
                0.05 * torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed))
            )
        setattr(model.model, name, layer)
    model.model.norm.register_forward_hook(
        lambda _m, _a, out: out + model.model.late(out) if use["late"] else out
    )
    if checkpointing:  # as coati_kto/train.py does
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), use


def _rows(rank: int, step: int, micro: int) -> torch.Tensor:
    """Rank ``rank``'s 2 rows of ``step``'s micro-batch ``micro`` (other rows on each rank)."""
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(3, 500, (2, 12), generator=gen)


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss / ACCUMULATION


def _weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _boosted(model_dir: str, plugin_kw: dict, checkpointing: bool) -> dict[str, Any]:
    """Train through the project's plan (``build_plugin``, ``boost``) with ``no_sync`` accumulation."""
    import contextlib

    from colossalai.booster import Booster

    from coati_kto.config.schema import PluginSection
    from coati_kto.parallel import optimizers
    from coati_kto.parallel.plan import ParallelPlan

    rank = torch.distributed.get_rank()
    model, use = _model(model_dir, checkpointing)
    plan = ParallelPlan.from_section(PluginSection(**plugin_kw), dp_size=2)
    assert plan.backend.no_sync_accumulation
    booster = Booster(plugin=plan.backend.build_plugin())
    optimizer = optimizers.make_optimizer(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    policy, optimizer, _ = plan.backend.boost(booster, model, optimizer, scheduler)
    ddp = getattr(booster.plugin, "ddp_kwargs", None) or booster.plugin.ddp_config
    assert ddp["find_unused_parameters"]  # the probe before boosting found ``never`` and ``late`` unreached
    for step in range(1, STEPS + 1):
        for micro in range(ACCUMULATION):
            use["late"] = step >= LATE_FROM and micro == 0 and rank == 0
            last = micro == ACCUMULATION - 1
            with contextlib.nullcontext() if last else booster.no_sync(policy, optimizer):
                booster.backward(_loss(policy, _rows(rank, step, micro)), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    inner = policy.unwrap()
    stateless = [n for n, p in inner.named_parameters() if not optimizer.optim.state.get(p)]
    return {"weights": _weights(inner), "stateless": stateless}


def _one_process(model_dir: str) -> dict[str, np.ndarray]:
    """The same steps on one process, no DDP, in DDP's order: each rank's gradient accumulated over its
    micro-batches, then divided by 2 and summed (an exact halving; a sum of two is the same in any order)."""
    from coati_kto.parallel import optimizers

    model, use = _model(model_dir, checkpointing=False)
    optimizer = optimizers.make_optimizer(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    params = list(model.parameters())
    for step in range(1, STEPS + 1):
        per_rank = []
        for rank in range(2):
            for micro in range(ACCUMULATION):
                use["late"] = step >= LATE_FROM and micro == 0 and rank == 0
                _loss(model, _rows(rank, step, micro)).backward()
            per_rank.append([p.grad for p in params])
            optimizer.zero_grad()  # sets .grad to None: the next rank's gradients are fresh tensors
        for param, g0, g1 in zip(params, *per_rank, strict=True):
            if g0 is not None or g1 is not None:  # DDP's bucket holds zeros for a rank's unused parameter
                zero = torch.zeros_like(param)
                param.grad = (g0 if g0 is not None else zero) / 2 + (g1 if g1 is not None else zero) / 2
        optimizer.step()
        optimizer.zero_grad()
    return _weights(model)


def _runs(model_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"initial": _weights(_model(model_dir, False)[0])}
    out["one_process"] = _one_process(model_dir)
    for key, (plugin, checkpointing) in PLUGINS.items():
        out[key] = _boosted(model_dir, plugin, checkpointing)
    return out


@pytest.fixture(scope="module")
def ranks(tiny_model_dir: Path) -> list[dict[str, Any]]:
    return run_distributed(_runs, 2, str(tiny_model_dir))


@pytest.mark.parametrize("plugin", list(PLUGINS))
def test_trains_like_one_process(ranks: list[dict[str, Any]], plugin: str) -> None:
    initial, expected = ranks[0]["initial"], ranks[0]["one_process"]
    for rank in ranks:
        got = rank[plugin]["weights"]
        assert got.keys() == expected.keys()
        # Never used: no gradient on any rank, so no update, no weight decay and no AdamW state.
        assert np.array_equal(got["model.never.weight"], initial["model.never.weight"])
        assert rank[plugin]["stateless"] == ["model.never.weight"]
        # Used late, on one rank's no_sync micro-batch: trained, from the gradient averaged over both ranks.
        assert not np.array_equal(got["model.late.weight"], initial["model.late.weight"])
        for name, value in expected.items():
            assert np.array_equal(got[name], value), f"{plugin} {name}: differs from one process"
        for name, value in ranks[0][plugin]["weights"].items():
            assert np.array_equal(got[name], value), f"{plugin} {name}: ranks differ"
