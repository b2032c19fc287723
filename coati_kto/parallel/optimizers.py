"""The run's optimizer: torch's fused AdamW on every device, or the variant ``train`` and ``plugin`` ask for."""

from __future__ import annotations

from typing import Any

import torch
from transformers.trainer_pt_utils import get_parameter_names

from coati_kto.config.train import separates_no_decay
from coati_kto.parallel.upstream.cpu import cuda_available

# What transformers' Trainer (and so TRL) leaves out of weight decay: every parameter of an nn.LayerNorm and every
# parameter whose lowercased name matches one of these (Trainer.get_decay_parameter_names, transformers 5;
# tests/unit/parallel/test_decay_groups.py holds this rule to transformers' own on each family).
NO_DECAY_NAMES = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")


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


def parameter_groups(
    model: torch.nn.Module, weight_decay: float, decay_norms_and_biases: bool, resumed_apart: bool = False
) -> list[Any]:
    """``model``'s parameters for the optimizer, in ``named_parameters`` order: one list (every parameter decays, or
    none does), or two groups, the decayed ones first and then the trainable biases and norm weights at weight
    decay 0 (:data:`NO_DECAY_NAMES`). Frozen parameters stay in the first group: ZeRO skips them, and a ZeRO
    plugin finds LoRA adapters by their frozen base layer. Unboosted model, every rank the same."""
    named = list(model.named_parameters())
    if not separates_no_decay(weight_decay, decay_norms_and_biases, resumed_apart=resumed_apart):
        return [param for _, param in named]
    decayed = set(get_parameter_names(model, [torch.nn.LayerNorm], list(NO_DECAY_NAMES)))
    kept = [param for name, param in named if name not in decayed and param.requires_grad]
    if not kept:  # LoRA on weight matrices only: nothing trainable to leave out
        return [param for _, param in named]
    kept_ids = {id(param) for param in kept}
    return [
        {"params": [param for _, param in named if id(param) not in kept_ids]},
        {"params": kept, "weight_decay": 0.0},
    ]


def set_weight_decay(optimizer: Any, weight_decay: float) -> None:
    """Give ``optimizer``'s groups this run's ``weight_decay`` after a resume (every rank): torch's and
    ColossalAI's loaders copy each saved group's settings back, so a changed train.weight_decay was named as
    applied and never used. Of two groups (:func:`parameter_groups`) the second, the biases and norm weights,
    stays at 0."""
    groups = optimizer.param_groups
    for group in groups[:1] if len(groups) == 2 else groups:
        group["weight_decay"] = weight_decay


def optimizer_for(
    model: torch.nn.Module, train: Any, cpu_offload: bool = False, resumed_apart: bool = False
) -> torch.optim.Optimizer:
    """``make_optimizer`` over ``model``'s :func:`parameter_groups`, with the ``train`` section's lr, weight decay
    and optimizer_state_dtype (``resumed_apart``: the checkpoint it resumes held biases and norms apart)."""
    groups = parameter_groups(model, train.weight_decay, train.decay_norms_and_biases, resumed_apart)
    return make_optimizer(
        groups, train.lr, train.weight_decay, state_dtype=train.optimizer_state_dtype, cpu_offload=cpu_offload,
        mixed_step=train.fused_optimizer,
    )  # fmt: skip
