"""The floor a training step's passes set on one CPU core: their matmul-class FLOPs at the core's GEMM rate.

Standard library at module level: TRL's child process (another virtual environment) imports this too; torch is
imported inside the functions.

- :func:`counter`: torch's ``FlopCounterMode`` for one step (forward and backward), which on this torch counts
  the CUDA attention kernels but not the CPU one; here CPU flash attention (``sdpa`` on CPU) is counted with
  torch's own formula, so both tools' attention is in the figure (the full score matrix, as torch counts it,
  causal or not).
- :func:`gemm_rate`: the best single-thread rate of ``F.linear`` over a model's GEMM shapes: what the core's
  matmul kernel reaches when nothing else runs.

Work / rate is a lower bound of a step's time: every matmul at the best rate measured, every other op free.
A benchmark that counts one step says so, and that step is left out of its timings (the mode slows it).
"""

from __future__ import annotations

import os
import time
from typing import Any

# The 1-based optimizer step whose FLOPs a benchmark child counts (0 or unset: none). The parent sets it in the
# environment of step_bench's children (through coati-kto's process) and in the TRL child's options.
FLOP_STEP_ENV = "COATI_BENCH_FLOP_STEP"


def flop_step() -> int:
    """The step :data:`FLOP_STEP_ENV` names (0: count none)."""
    return int(os.environ.get(FLOP_STEP_ENV, "0") or 0)


def counter() -> Any:
    """A ``torch.utils.flop_counter.FlopCounterMode`` (display off) that also counts CPU flash attention."""
    import torch
    from torch.utils import flop_counter

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    aten = torch.ops.aten
    return flop_counter.FlopCounterMode(
        display=False,
        custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
        },
    )


def counted(mode: Any) -> dict[str, float]:
    """FLOPs of an exited :func:`counter`: ``matmul`` (mm, addmm, bmm), ``attention`` (sdpa kernels), ``total``."""
    by_op = {str(op): float(n) for op, n in mode.get_flop_counts().get("Global", {}).items()}
    attention = sum(n for op, n in by_op.items() if "scaled_dot_product" in op or "attention" in op)
    total = float(mode.get_total_flops())
    return {"matmul": total - attention, "attention": attention, "total": total}


def gemm_rate(tokens: int, dims: list[tuple[int, int]], repeats: int = 5) -> float:
    """Best FLOP/s of ``F.linear`` on one thread over [tokens, k] x [k, n] for each (k, n) in ``dims``."""
    import torch

    torch.set_num_threads(1)
    best = 0.0
    for k, n in dims:
        x, w = torch.randn(tokens, k), torch.randn(n, k)
        torch.nn.functional.linear(x, w)  # warm-up: the kernel's first call allocates and picks its path
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = max(best, 2.0 * tokens * k * n / (time.perf_counter() - start))
    return best
