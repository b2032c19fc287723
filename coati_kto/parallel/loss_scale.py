"""The fp16 dynamic loss scale of a plugin optimizer: read (clipping, logging) and carried through a checkpoint.

ColossalAI 0.5.0 keeps it in the optimizer's fp16 mixin (ZeRO's ``mixed_precision_mixin``, the hybrid AMP
optimizer's ``mixed_precision``), a ``DynamicGradScaler``; bf16 and fp32 optimizers have none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def loss_scale(optimizer: Any) -> float | None:
    """The fp16 dynamic loss scale of a plugin optimizer; None without one (bf16, fp32, DDP)."""
    scale = getattr(_mixin(optimizer), "loss_scale", None)  # fp16 mixins only; bf16 has no scale
    return float(scale) if scale is not None else None


@contextlib.contextmanager
def gradient_scale_held(optimizer: Any) -> Iterator[None]:
    """Within it ``gradient_scale`` is the loss scale as it entered: the one the gradients being stepped carry."""
    optimizer._coati_grad_scale = loss_scale(optimizer)
    try:
        yield
    finally:
        optimizer._coati_grad_scale = None


def gradient_scale(optimizer: Any) -> float | None:
    """The fp16 loss scale to divide the gradients by in ``step``. Inside ``step`` the scaler's update runs first
    (``should_skip_step``) and, every ``growth_interval`` clean steps, doubles the scale before the gradients are
    unscaled: upstream then divides by the next step's scale, and the update is half the gradient. Within
    ``gradient_scale_held`` (``optimizer_path.given_norm``: every training step), the scale before that update;
    outside, the scale at the time (upstream's order)."""
    held = getattr(optimizer, "_coati_grad_scale", None)
    return held if held is not None else loss_scale(optimizer)


def skipped_by_loss_scaler(optimizer: Any) -> bool:
    """Whether the fp16 loss scaler skipped the step just taken (an overflow in the scaled gradients: upstream's
    ``step`` zeroes them and backs off); False without fp16. From the scaler's counters, no host sync: an overflow
    zeroes the growth count and raises the hysteresis count, a growth zeroes both, a clean step raises the growth
    count. The same on every rank (the overflow vote is global). Call right after ``step``."""
    scaler = _loss_scaler(optimizer)
    return scaler is not None and scaler._growth_step == 0 and scaler._hysteresis_step > 0


def _mixin(optimizer: Any) -> Any | None:
    return getattr(optimizer, "mixed_precision_mixin", None) or getattr(optimizer, "mixed_precision", None)


def _loss_scaler(optimizer: Any) -> Any | None:
    """The fp16 mixin's ``DynamicGradScaler``; None without fp16."""
    return getattr(_mixin(optimizer), "grad_scaler", None)


def loss_scaler_state(optimizer: Any) -> dict[str, Any] | None:
    """What the fp16 loss scaler will do next: the scale and its two counters (steps since the last overflow or
    growth, overflows within the hysteresis); None without fp16. ColossalAI 0.5.0's checkpoint IO saves none of it,
    so a resumed fp16 run restarted at the initial scale and skipped steps on overflow until it came back down.
    The same on every rank (the overflow vote is global). Any rank, local."""
    scaler = _loss_scaler(optimizer)
    if scaler is None:
        return None
    return {
        "scale": scaler.scale.detach().cpu(),
        "growth_step": scaler._growth_step,
        "hysteresis_step": scaler._hysteresis_step,
    }


def restore_loss_scaler(optimizer: Any, state: dict[str, Any] | None) -> None:
    """Put back what :func:`loss_scaler_state` saved (nothing without fp16, or from a checkpoint without it)."""
    scaler = _loss_scaler(optimizer)
    if scaler is None or state is None:
        return
    scaler._scale = state["scale"].to(device=scaler.scale.device, dtype=scaler.scale.dtype)
    scaler._growth_step, scaler._hysteresis_step = state["growth_step"], state["hysteresis_step"]
