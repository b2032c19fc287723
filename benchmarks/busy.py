"""The GPU's busy time per kernel category, from a torch.profiler run: where the step's kernel time goes, in the
kernel counter's categories (coati_kto.testing.kernels), so that the CUDA profile and the CPU prediction read
side by side (benchmarks/gpu_bench.py prints both).

Each CUDA kernel is attributed through the op that launched it (the profiler links a kernel to its CPU op by
correlation id) and that op's parents, innermost first, then its own name: NCCL kernels are gradient
reductions; anything under ``Optimizer.step`` is the optimizer, except a norm there (the gradient norm);
attention ops (sdpa, flash, efficient, cuDNN, FlexAttention's Triton template ``triton_tem_*``, varlen); the
log-softmax and gather of the LM head; matmuls; casts and copies; the remaining elementwise and reduction
kernels (norms, rotary, activations, the loss). The profiler has no Python context, so the chunked LM head's
matmul counts as a matmul here (the counter puts it under the head), and a kernel launched outside any op is
left "other".
"""

from __future__ import annotations

from typing import Any

MATMUL, ATTENTION, POINTWISE, COPIES = (
    "model matmuls",
    "attention",
    "norms / rotary / activations",
    "casts and copies",
)
HEAD, GRADS, NORM, OPTIMIZER, OTHER = (
    "LM head and log-softmax",
    "gradient buckets and reductions",
    "gradient norm",
    "optimizer",
    "other",
)
_ATTENTION = (
    "scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flex_attention",
    "varlen_attn", "fmha", "flash_fwd", "flash_bwd", "triton_tem_",
)  # fmt: skip
_HEAD = ("log_softmax", "logsumexp", "aten::gather", "aten::take_along_dim")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")
_COPIES = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::cat")
_NORMS = ("norm",)


def kernel_category(kernel: str, chain: list[str]) -> str:
    """The category of a CUDA kernel named ``kernel`` launched by the ops ``chain`` (innermost first)."""
    names = [*chain, kernel]
    if "nccl" in kernel.lower():
        return GRADS
    if any(n.startswith("Optimizer.step") for n in chain):
        return NORM if any(any(k in n for k in _NORMS) for n in chain[:2]) else OPTIMIZER
    for category, keys in ((ATTENTION, _ATTENTION), (HEAD, _HEAD)):
        if any(k in n for n in names for k in keys):
            return category
    for category, keys in ((MATMUL, _MATMUL), (COPIES, _COPIES)):
        if chain and chain[0] in keys:
            return category
    if any(k in kernel for k in ("gemm", "nvjet", "xmma", "cutlass")):
        return MATMUL
    if "copy" in kernel.lower() or "cast" in kernel.lower():
        return COPIES
    return POINTWISE if chain else OTHER


def busy_by_category(events: list[Any], lo: float, hi: float, steps: int, busy_ms: float) -> dict[str, float]:
    """ms of CUDA kernel time per optimizer step and category, over the CPU ops that start in [lo, hi) (the
    profiled steps after the first); what no op launched (of ``busy_ms``, the step's kernel time) is "other"."""
    out: dict[str, float] = {OTHER: busy_ms}
    for event in events:
        kernels = getattr(event, "kernels", None)
        if not kernels or not lo <= event.time_range.start < hi:
            continue
        chain, parent = [], event
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        for kernel in kernels:
            if kernel.name.startswith(("Memcpy", "Memset")):  # copies the step's busy time leaves out too
                continue
            category = kernel_category(kernel.name, chain)
            ms = kernel.duration / 1e3 / steps
            out[category] = out.get(category, 0.0) + ms
            out[OTHER] -= ms
    out[OTHER] = max(out[OTHER], 0.0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
