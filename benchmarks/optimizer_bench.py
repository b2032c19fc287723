"""The bf16 optimizer step alone, today's path against ``train.fused_optimizer`` (coati_kto.parallel.mixed_adamw).

Both update fp32 masters from bf16 gradients and write the bf16 working weights, on a Llama-shaped list of
tensors (embedding, per layer 4 attention and 3 MLP matrices and 2 norms, final norm, head):

- ``cast+fused``: what the AMP / one-rank ZeRO step runs without it (coati_kto.parallel.optimizer_path): the
  gradients cast to fp32 (one multi-tensor copy), ``torch.optim.AdamW(fused=True)``, the masters copied into the
  working weights (one multi-tensor copy);
- ``mixed``: ``MixedAdamW``, one compiled pass.

Printed per path: the first call's seconds (``mixed``: dynamo and inductor compiling), the median step in ms
(CUDA: synchronized), and the kernel counter's kernels and bytes per parameter (coati_kto.testing.kernels).

    PYTHONPATH=. .venv/bin/python benchmarks/optimizer_bench.py              # ~1B Llama shapes on CUDA
    PYTHONPATH=. .venv/bin/python benchmarks/optimizer_bench.py --smoke      # seconds on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from coati_kto.parallel.mixed_adamw import MixedAdamW
from coati_kto.testing.kernels import KernelCounter


def llama_shapes(layers: int, hidden: int, vocab: int) -> list[tuple[int, ...]]:
    """The trainable tensors of a Llama of ``layers`` x ``hidden`` (MLP 4x wider), untied head."""
    block = [(hidden, hidden)] * 4 + [(4 * hidden, hidden)] * 2 + [(hidden, 4 * hidden)] + [(hidden,)] * 2
    return [(vocab, hidden), *block * layers, (hidden,), (vocab, hidden)]


def paths(shapes: list[tuple[int, ...]], device: torch.device) -> dict[str, Callable[[], None]]:
    """name -> one optimizer step over fresh masters, bf16 gradients and bf16 working weights."""

    def tensors() -> tuple[list[torch.nn.Parameter], list[torch.Tensor], list[torch.Tensor]]:
        masters = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
        grads = [torch.randn(s, device=device).bfloat16() * 1e-3 for s in shapes]
        return masters, grads, [m.detach().bfloat16() for m in masters]

    masters, grads, working = tensors()
    plain = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.01, fused=True)

    def cast_fused() -> None:
        fp32 = [torch.empty_like(m) for m in masters]
        torch._foreach_copy_(fp32, grads)
        for master, grad in zip(masters, fp32, strict=True):
            master.grad = grad
        plain.step()
        torch._foreach_copy_(working, [m.detach() for m in masters])

    m_masters, m_grads, m_working = tensors()
    mixed = MixedAdamW(m_masters, lr=1e-4, weight_decay=0.01)

    def mixed_step() -> None:
        with mixed.mixed(list(zip(m_masters, m_grads, m_working, strict=True)), 1.0):
            mixed.step()

    return {"cast+fused": cast_fused, "mixed": mixed_step}


def measure(step: Callable[[], None], repeats: int, params: int, cuda: bool) -> dict[str, float]:
    """First call's seconds, median step ms, and one counted step's kernels and bytes per parameter."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - started)
    with KernelCounter() as counter:
        step()
    cost = counter.summary(params)
    return {
        "first_s": first,
        "step_ms": 1e3 * statistics.median(times),
        "kernels": cost["kernels"],
        "bytes_per_param": cost["bytes_per_param"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 layers x 64 on the CPU, 3 repeats")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.vocab, args.repeats = 2, 64, 512, 3
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    shapes = llama_shapes(args.layers, args.hidden, args.vocab)
    params = sum(torch.Size(s).numel() for s in shapes)
    print(f"device {device}, {params / 1e6:.1f}M parameters in {len(shapes)} tensors")
    print(f"{'path':<12}{'first_s':>10}{'step_ms':>10}{'kernels':>9}{'bytes/param':>13}")
    for name, step in paths(shapes, device).items():
        row = measure(step, args.repeats, params, cuda)
        print(
            f"{name:<12}{row['first_s']:>10.4f}{row['step_ms']:>10.2f}{row['kernels']:>9d}"
            f"{row['bytes_per_param']:>13.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
