"""AdamW whose step reads the working (bf16) gradients and writes the working weights in the same compiled pass
(``train.fused_optimizer``): one mixed-precision update per parameter, 28 bytes per parameter.

Torch's fused AdamW kernel takes one dtype, so a bf16 run's step was three passes: the bf16 gradients cast to
fp32 (2 bytes read, 4 written), the kernel on the fp32 masters (28), the masters cast into the bf16 working
weights (4 read, 2 written): 40 bytes per parameter. Here one plain PyTorch function over the parameter lists
(:func:`_mixed_adamw_`, multi-tensor ops) is compiled by inductor: the CPU runs its C++ kernels (every tensor in one or two
generated kernels), CUDA its triton kernels (inductor groups the multi-tensor ops horizontally); it reads the bf16
gradient (2), the fp32 master and moments (12), and writes the master, the moments (12) and the bf16 weight (2).

:class:`MixedAdamW` is ``torch.optim.AdamW(fused=True)``: the same parameter groups, state (``step`` a 0-dim
fp32 tensor on the parameter's device, ``exp_avg`` and ``exp_avg_sq`` like the parameter), ``state_dict`` and
hooks, so checkpoints load either way. Its plain ``step()`` is torch's; inside ``mixed(...)`` it takes the
gradients and the tensors to write from the plugin's step (``coati_kto.parallel.optimizer_path``). The update is
torch's AdamW within fp32 rounding (the bias corrections from the step count on the device: no host read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from coati_kto.parallel.compiled import CompiledForward


def _mixed_adamw_(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    avgs: list[torch.Tensor],
    sqs: list[torch.Tensor],
    workings: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: torch.Tensor,
    decay: torch.Tensor,
    coef: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """In place: AdamW (decoupled weight decay, bias corrections) on the fp32 ``masters`` with ``grads`` (any float
    dtype, the master's numel) times the clip coefficient; the updated masters rounded into ``workings``.
    ``lr``, ``decay`` (``1 - lr * weight_decay``) and ``coef``: 0-dim fp64 on the host (tensors: a new lr or
    coefficient does not recompile; each used as it is, a scalar argument of the kernels). ``steps`` (0-dim
    fp32) are incremented first, as torch's fused AdamW does."""
    torch._foreach_add_(steps, 1)
    g32 = torch._foreach_mul([g.view_as(m).float() for g, m in zip(grads, masters, strict=True)], coef)
    torch._foreach_mul_(masters, decay)
    torch._foreach_lerp_(avgs, g32, 1 - beta1)
    torch._foreach_mul_(sqs, beta2)
    torch._foreach_addcmul_(sqs, g32, g32, 1 - beta2)
    bias1 = torch._foreach_add(torch._foreach_neg(torch._foreach_pow(beta1, steps)), 1)
    bias2 = torch._foreach_add(torch._foreach_neg(torch._foreach_pow(beta2, steps)), 1)
    denom = torch._foreach_div(torch._foreach_sqrt(sqs), torch._foreach_sqrt(bias2))
    torch._foreach_add_(denom, eps)
    torch._foreach_sub_(
        masters, torch._foreach_div(torch._foreach_mul(avgs, lr), torch._foreach_mul(denom, bias1))
    )
    torch._foreach_copy_(workings, [m.view_as(w) for m, w in zip(masters, workings, strict=True)])


_STEP: list[CompiledForward] = []  # compiled once per process (the counter sees it as the optimizer's region)


def compiled_step() -> CompiledForward:
    """The compiled :func:`_mixed_adamw_`, built on first use. Static shapes: a parameter group's masters keep
    theirs for the whole run, so each group compiles once (a new list of shapes compiles a graph of its own)."""
    if not _STEP:
        _STEP.append(CompiledForward(_mixed_adamw_, "optimizer", dynamic=False))
    return _STEP[0]


class MixedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(fused=True)`` whose step, inside :meth:`mixed`, is the one-pass mixed-precision update."""

    def __init__(self, params: Iterable[Any], lr: float, weight_decay: float) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, fused=True)
        self._pending: tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], float] | None = None

    @contextlib.contextmanager
    def mixed(
        self, updates: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], coef: float
    ) -> Iterator[None]:
        """Within it ``step()`` updates each (master, gradient, working) triple: the master (one of this optimizer's
        parameters, fp32) with ``gradient * coef`` (working dtype, the master's numel, not copied), and writes the
        result into ``working`` (working dtype, the master's numel). Masters not named are not updated."""
        self._pending = ({id(m): (g, w) for m, g, w in updates}, coef)
        try:
            yield
        finally:
            self._pending = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self._pending is None:
            return super().step(closure)
        if closure is not None:
            raise ValueError("closure is not supported by the mixed-precision step")
        updates, coef = self._pending
        for group in self.param_groups:
            masters = [p for p in group["params"] if id(p) in updates]
            if masters:
                self._update(group, masters, [updates[id(m)][0] for m in masters],
                             [updates[id(m)][1] for m in masters], coef)  # fmt: skip
        return None

    def _update(self, group: dict[str, Any], masters: list[torch.Tensor], grads: list[torch.Tensor],
                workings: list[torch.Tensor], coef: float) -> None:  # fmt: skip
        for m in masters:  # torch's lazy state, as AdamW(fused=True) makes it
            state = self.state[m]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=m.device)
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
        states = [self.state[m] for m in masters]
        beta1, beta2 = group["betas"]
        # on the host: a CPU 0-dim input is a scalar argument of the generated kernels (no copy, no sync)
        lr, decay = group["lr"], 1.0 - group["lr"] * group["weight_decay"]
        scalars = [torch.tensor(x, dtype=torch.float64) for x in (lr, decay, coef)]
        compiled_step()(masters, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                        workings, [s["step"] for s in states], *scalars, beta1, beta2, group["eps"])  # fmt: skip
