"""The run's optimizer: torch's fused AdamW on every device, or the variant ``train`` and ``plugin`` ask for."""

from __future__ import annotations

from typing import Any

import torch

from coati_kto.parallel.upstream.cpu import cuda_available


def make_optimizer(
    params: Any,
    lr: float,
    weight_decay: float,
    fused_ok: bool = True,
    state_dtype: str = "fp32",
    cpu_offload: bool = False,
    mixed_step: bool = False,
) -> torch.optim.Optimizer:
    """The run's AdamW: ``torch.optim.AdamW(fused=True)`` on every device (one ``_fused_adamw_`` kernel per step
    over each device and dtype group: the same op on CPU and CUDA, so the CPU's kernel count is the GPU's).

    ``cpu_offload`` on CUDA: ColossalAI's HybridAdam (upstream's optimizer for offload: its CPU Adam for the
    CPU-side masters). ``fused_ok`` False: the single-tensor ``torch.optim.AdamW`` (the reference update).
    ``state_dtype`` bf16: the project's AdamW with bf16 moments on every device (coati_kto.parallel.adamw).
    ``mixed_step`` (``train.fused_optimizer``): ``MixedAdamW``, torch's fused AdamW whose plugin step is one
    compiled mixed-precision pass (coati_kto.parallel.mixed_adamw).
    """
    if mixed_step:
        from coati_kto.parallel.mixed_adamw import MixedAdamW

        return MixedAdamW(params, lr=lr, weight_decay=weight_decay)
    if state_dtype == "bf16":
        from coati_kto.parallel.adamw import AdamWLowPrecisionStates

        return AdamWLowPrecisionStates(params, lr=lr, weight_decay=weight_decay)
    if cpu_offload and cuda_available() and fused_ok:
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, lr=lr, weight_decay=weight_decay, adamw_mode=True)
    if fused_ok:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=False)


def optimizer_for(params: Any, train: Any, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """``make_optimizer`` with the ``train`` section's lr, weight_decay and optimizer_state_dtype."""
    return make_optimizer(
        params, train.lr, train.weight_decay, state_dtype=train.optimizer_state_dtype, cpu_offload=cpu_offload,
        mixed_step=train.fused_optimizer,
    )  # fmt: skip
