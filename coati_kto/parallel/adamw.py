"""AdamW with its two moment estimates stored in bf16 (``train.optimizer_state_dtype: bf16``).

Adam's states are 8 of the 16 bytes per parameter an fp32-master optimizer keeps (fp32 master 4, the two
moments 8, the bf16 working copy and gradient 4) and, with the master, most of the optimizer step's memory
traffic: in bf16 they are 4 bytes, read and written once per step. The arithmetic stays fp32: each step copies
the moments into fp32, updates them and the parameter with the kernel ``torch.optim.AdamW(fused=True)`` runs
(``_fused_adamw_``: decoupled weight decay, bias corrections, one pass), then rounds the moments to bf16 for
storage. Torch's fused kernel takes one dtype for all its tensors, so the copies are separate passes: this
saves memory (4 bytes per parameter), not memory traffic (52 bytes per parameter per step against the fp32
fused step's 28). What is lost is the moments' precision between steps (8 bits of mantissa), not the update's.

Checkpoints hold the bf16 moments; a loader that casts them to the parameter's dtype (ColossalAI's hybrid
checkpoint IO, ``torch.optim.Optimizer.load_state_dict``) changes no value, and the next step stores them in
bf16 again: a resumed run continues bit for bit. The default (fp32 states) is ``torch.optim.AdamW(fused=True)``
/ HybridAdam, untouched (``coati_kto.parallel.optimizers.make_optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class AdamWLowPrecisionStates(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW``'s defaults and update) whose ``exp_avg`` / ``exp_avg_sq`` are ``state_dtype``.

    Parameters and gradients of any floating dtype (fp32 masters under ZeRO / AMP); per parameter group and
    (device, dtype): two multi-tensor copies, the step count, one fused AdamW kernel.
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
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(
                    param, dtype=self.state_dtype, memory_format=torch.preserve_format
                )
        # a loader may leave the count on the host; the fused kernel reads it on the parameter's device
        if state["step"].device != param.device:
            state["step"] = state["step"].to(param.device)
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
            buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:  # the fused kernel takes one device and dtype
                    buckets.setdefault((p.device, p.dtype), []).append(p)
            for params in buckets.values():
                self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """One step over ``params``: the moments copied to fp32 (one multi-tensor copy), torch's fused AdamW kernel
        (``_fused_adamw_``, as ``torch.optim.AdamW(fused=True)``) on the fp32 values, the moments rounded back to
        ``state_dtype`` (one multi-tensor copy): 4 kernels whatever the number of parameters."""
        beta1, beta2 = group["betas"]
        # the fused kernel takes one dtype: gradients of another (bf16 under AMP) in the parameters' dtype
        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        steps, avgs, sqs = zip(*(self._moments(p) for p in params), strict=True)
        m = [torch.empty_like(p) for p in params]
        v = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(m + v, list(avgs) + list(sqs))
        torch._foreach_add_(list(steps), 1.0)
        torch._fused_adamw_(
            params, grads, m, v, [], list(steps), lr=group["lr"], beta1=beta1, beta2=beta2,
            weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip
        torch._foreach_copy_(list(avgs) + list(sqs), m + v)  # rounded to state_dtype for storage
