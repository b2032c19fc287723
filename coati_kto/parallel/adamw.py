"""AdamW with its two moment estimates stored in bf16 (``train.optimizer_state_dtype: bf16``).

Adam's states are 8 of the 16 bytes per parameter an fp32-master optimizer keeps (fp32 master 4, the two
moments 8, the bf16 working copy and gradient 4) and, with the master, most of the optimizer step's memory
traffic: in bf16 they are 4 bytes, read and written once per step. The arithmetic stays fp32: each step reads
the moments into fp32, updates them exactly as ``torch.optim.AdamW`` does (decoupled weight decay, ``lerp`` of
the first moment, bias corrections), updates the parameter from the fp32 values, then rounds the moments to bf16
for storage. What is lost is the moments' precision between steps (8 bits of mantissa), not the update's.

Checkpoints hold the bf16 moments; a loader that casts them to the parameter's dtype (ColossalAI's hybrid
checkpoint IO, ``torch.optim.Optimizer.load_state_dict``) changes no value, and the next step stores them in
bf16 again: a resumed run continues bit for bit. The default (fp32 states) is ``torch.optim.AdamW`` / HybridAdam,
untouched (``coati_kto.parallel.compat.make_optimizer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamWLowPrecisionStates(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and update) whose ``exp_avg`` / ``exp_avg_sq`` are ``state_dtype``.

    Parameters and gradients of any floating dtype (fp32 masters under ZeRO / AMP); one ``torch._foreach`` op per
    stage over a parameter group.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        state_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.state_dtype = state_dtype

    def _moments(self, param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(step, exp_avg, exp_avg_sq) of ``param``, created on its first step, stored in ``state_dtype``."""
        state = self.state[param]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(
                    param, dtype=self.state_dtype, memory_format=torch.preserve_format
                )
        for key in ("exp_avg", "exp_avg_sq"):
            if (
                state[key].dtype != self.state_dtype
            ):  # a loader cast them (exact: they were state_dtype values)
                state[key] = state[key].to(self.state_dtype)
        return state["step"], state["exp_avg"], state["exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        grads = [p.grad.float() if p.grad.dtype != p.dtype else p.grad for p in params]
        steps, avgs, sqs = zip(*(self._moments(p) for p in params), strict=True)
        torch._foreach_add_(list(steps), 1.0)
        step = float(steps[0])  # CPU tensors, as torch's AdamW (capturable=False): no device sync
        if decay != 0:
            torch._foreach_mul_(params, 1 - lr * decay)
        m = [a.float() for a in avgs]
        v = [s.float() for s in sqs]
        torch._foreach_lerp_(m, grads, 1 - beta1)
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, grads, grads, 1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - beta2**step))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, m, denom, -step_size)
        torch._foreach_copy_(list(avgs), m)  # rounded to state_dtype for storage
        torch._foreach_copy_(list(sqs), v)
