"""AdamWLowPrecisionStates (train.optimizer_state_dtype): torch's AdamW update, moments stored in bf16."""

from __future__ import annotations

import copy

import torch

from coati_kto.parallel.adamw import AdamWLowPrecisionStates


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((64, 32), (32,), (7, 5))]


def _run(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()


def test_fp32_states_are_torch_fused_adamw_bit_for_bit() -> None:
    ours, theirs, single = _params(), _params(), _params()
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    _run(AdamWLowPrecisionStates(ours, state_dtype=torch.float32, **kwargs), ours, range(6))
    _run(torch.optim.AdamW(theirs, fused=True, **kwargs), theirs, range(6))
    _run(torch.optim.AdamW(single, foreach=False, **kwargs), single, range(6))
    for a, b, c in zip(ours, theirs, single, strict=True):
        assert torch.equal(a, b)  # the same kernel on the same values
        # torch's single-tensor AdamW: the same update within fp32 rounding (values of order 1, 6 steps)
        assert float((a - c).detach().abs().max()) <= 1e-6


def test_bf16_states_are_bf16_close_to_fp32_and_resume_exactly() -> None:
    params, fp32 = _params(), _params()
    optimizer = AdamWLowPrecisionStates(params, lr=1e-2, weight_decay=0.1)
    _run(optimizer, params, range(3))
    saved_params, saved_state = (
        copy.deepcopy([p.detach() for p in params]),
        copy.deepcopy(optimizer.state_dict()),
    )
    _run(optimizer, params, range(3, 6))
    states = [s for st in optimizer.state.values() for k, s in st.items() if k != "step"]
    assert len(states) == 6 and all(s.dtype == torch.bfloat16 for s in states)

    _run(torch.optim.AdamW(fp32, lr=1e-2, weight_decay=0.1), fp32, range(6))
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(params, fp32, strict=True))
    assert 0 < diff < 1e-3  # rounded moments: a different, close trajectory (6 steps of lr 1e-2)

    # Resume: torch's loader casts the moments to the parameters' fp32 (exact); the next step stores bf16 again.
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    again = AdamWLowPrecisionStates(resumed, lr=1e-2, weight_decay=0.1)
    again.load_state_dict(saved_state)
    assert all(s.dtype == torch.float32 for st in again.state.values() for k, s in st.items() if k != "step")
    _run(again, resumed, range(3, 6))
    for a, b in zip(params, resumed, strict=True):
        assert torch.equal(a, b)
