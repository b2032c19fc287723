"""Model FLOPs of the passes a step actually runs, and MFU against a per-device peak.

FLOPs per non-padding token: 2 N for a forward pass, 6 N for a forward + backward (the usual dense-transformer
estimate; attention's S^2 term is left out, gradient-checkpointing recomputation is not counted: it is not
model work). N counts every parameter except the input embeddings (a lookup, no multiply-adds); a head tied
to them counts once. Passes that do not run (a cached reference) add nothing.

MFU = model FLOPs per second / (peak per device x devices). The peak comes from ``train.peak_flops`` or, for
bf16/fp16 training on a GPU listed in :data:`PEAK_FLOPS`, from the device name; otherwise MFU is not logged.
"""

from __future__ import annotations

from typing import Any

import torch

from coati_kto.models.lora import base_module

# Dense bf16/fp16 tensor-core peak per device, FLOP/s (vendor datasheets, no sparsity), matched as substrings
# of torch.cuda.get_device_name(), first match wins (more specific names first).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("RTX A6000", 155e12),
    ("V100", 125e12),
    ("T4", 65e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)


def table_peak_flops(device_name: str) -> float | None:
    """The table's dense bf16/fp16 peak for ``device_name`` (e.g. "NVIDIA H100 80GB HBM3"), or None."""
    for key, peak in PEAK_FLOPS:
        if key in device_name:
            return peak
    return None


def resolve_peak_flops(configured: float | None, precision: str) -> tuple[float | None, str]:
    """(peak FLOP/s per device or None, where it came from): ``train.peak_flops`` first, then the table.

    The table holds bf16/fp16 peaks, so fp32 training (and CPUs) get a peak only when the user sets one.
    """
    if configured:
        return configured, "train.peak_flops"
    if precision not in ("bf16", "fp16") or not torch.cuda.is_available():
        return None, f"unknown for {precision} on this device (set train.peak_flops)"
    name = torch.cuda.get_device_name()
    peak = table_peak_flops(name)
    return (peak, f"table: {name}") if peak else (None, f"unknown device {name!r} (set train.peak_flops)")


def peak_flops_line(peak_flops: float | None, source: str) -> str:
    """The one line rank 0 prints at setup: what train/mfu is measured against, or why it is not logged."""
    shown = (
        f"against {peak_flops:.4g} FLOP/s per device ({source})"
        if peak_flops
        else f"not logged: peak FLOP/s {source}"
    )
    return f"train/mfu {shown}"


def flop_params(model: Any) -> int:
    """N of a (possibly boosted, possibly tensor-parallel) causal LM: every parameter but the input embeddings.

    Tensor-parallel shards count at their global shape, so every rank gets the whole model's N.
    """

    inner = base_module(model)
    try:
        from colossalai.tensor.d_tensor import get_global_shape, is_distributed_tensor
    except ImportError:
        is_distributed_tensor = None
    embed = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is not None:
        skip -= {id(p) for p in head.parameters()}  # tied: the head's multiply-adds are real
    total, seen = 0, set()
    for p in inner.parameters():
        if id(p) in seen or id(p) in skip:
            continue
        seen.add(id(p))
        if is_distributed_tensor is not None and is_distributed_tensor(p):
            total += int(torch.Size(get_global_shape(p)).numel())
        else:
            total += p.numel()
    return total


def forward_flops(params: int, tokens: int) -> float:
    """2 N per token of a forward pass (no gradient)."""
    return 2.0 * params * tokens


def train_flops(params: int, tokens: int) -> float:
    """6 N per token of a forward + backward pass."""
    return 6.0 * params * tokens


def mfu(flops_per_second: float, peak_per_device: float | None, devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] (None without a peak)."""
    if not peak_per_device:
        return None
    return flops_per_second / (peak_per_device * devices)
