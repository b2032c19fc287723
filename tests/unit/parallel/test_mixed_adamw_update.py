"""MixedAdamW (train.fused_optimizer): torch's AdamW update from working-dtype gradients in one compiled pass."""

from __future__ import annotations

import pytest
import torch

from coati_kto.parallel.mixed_adamw import MixedAdamW
from coati_kto.testing.kernels import KernelCounter

pytestmark = pytest.mark.compile  # inductor builds the step's C++ kernel
SHAPES = [(64, 32), (32,), (128, 64), (64,)]


def test_mixed_step_is_adamw_and_costs_one_pass() -> None:
    """4 steps with a new lr and clip coefficient each: within fp32 rounding of torch's single-tensor AdamW on
    the same masters and bf16 gradients; the working copies are the masters in bf16; one compiled graph (no
    recompile); the state and state_dict of AdamW(fused=True). Counted: one kernel reading the bf16 gradient and
    the fp32 master and moments and writing them and the bf16 copy (28 bytes per parameter), no host sync (dynamo's
    guards read the host scalars lr and coefficient: they were counted as 3 syncs)."""
    from torch._dynamo.utils import counters

    gen = torch.Generator().manual_seed(0)
    masters = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    copies = [torch.nn.Parameter(m.detach().clone()) for m in masters]
    fused = MixedAdamW(masters, lr=1e-2, weight_decay=0.1)
    reference = torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, foreach=False)
    working = [m.detach().bfloat16() for m in masters]
    graphs = None
    for step in range(4):
        grads = [torch.randn(s, generator=gen).bfloat16() for s in SHAPES]
        coef = 1.0 if step < 2 else 0.3 / step
        fused.param_groups[0]["lr"] = reference.param_groups[0]["lr"] = 1e-2 * (step + 1)
        with KernelCounter() as count, fused.mixed(list(zip(masters, grads, working, strict=True)), coef):
            fused.step()
        graphs = graphs if graphs is not None else counters["stats"]["unique_graphs"]
        for c, g in zip(copies, grads, strict=True):
            c.grad = g.float() * coef
        reference.step()
        assert (
            max(float((m.detach() - c.detach()).abs().max()) for m, c in zip(masters, copies, strict=True))
            < 2e-6
        )
        assert all(torch.equal(w, m.detach().bfloat16()) for w, m in zip(working, masters, strict=True))
        cost = count.summary(sum(m.numel() for m in masters))
        if step == 0:  # the first step also creates the moments and step counts
            continue
        assert cost["categories"]["optimizer"]["kernels"] == cost["kernels"] <= 2, cost["categories"]
        assert abs(cost["categories"]["optimizer"]["bytes_per_param"] - 28.0) < 0.1
        assert cost["syncs"] == 0, cost["syncs_by_op"]
    assert counters["stats"]["unique_graphs"] == graphs  # a new lr or coefficient did not recompile
    ours, torchs = fused.state_dict(), torch.optim.AdamW(copies, lr=1e-2, weight_decay=0.1, fused=True)
    torchs.load_state_dict(ours)  # torch's fused AdamW takes it as its own, and the other way
    fused.load_state_dict(torchs.state_dict())
    assert ours["param_groups"][0].keys() == torchs.state_dict()["param_groups"][0].keys()
    for a, b in zip(ours["state"].values(), reference.state_dict()["state"].values(), strict=True):
        assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}
        assert float(a["step"]) == 4.0
