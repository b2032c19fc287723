"""Naive fp32 log_softmax vs chunked sequence_logps: time and peak extra memory, on CPU.

    PYTHONPATH=. python benchmarks/logprobs_bench.py [--batch 8 --seq 512 --vocab 32000 --reps 3]

(PYTHONPATH not needed once coati_kto is installed.)

Timings: all variants in one process, interleaved round by round (the machine may be shared). Memory: each
(variant, mask) once more in its own subprocess, where peak RSS (ru_maxrss, a high-water mark) minus the RSS
after building the inputs is that variant's peak extra memory, forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from coati_kto.logprobs import sequence_logps

MIB = 1 << 20


def naive(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.where(mask[:, 1:], tok, torch.zeros_like(tok)).sum(-1)


def make_inputs(batch: int, seq: int, vocab: int, full_mask: bool):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=g, dtype=torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    for b in range(batch):
        if full_mask:
            mask[b, 1:] = True
        else:  # prompt of 10-40% of the sequence, then a completion, then right padding
            prompt = int(seq * (0.1 + 0.3 * torch.rand(1, generator=g)))
            end = int(seq * (0.6 + 0.4 * torch.rand(1, generator=g)))
            mask[b, prompt:end] = True
    return logits, ids, mask


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MIB


def run_once(variant: str, chunk: int | None, logits, ids, mask) -> float:
    x = logits.detach().requires_grad_()
    t0 = time.perf_counter()
    out = naive(x, ids, mask) if variant == "naive" else sequence_logps(x, ids, mask, chunk)
    out.sum().backward()
    return time.perf_counter() - t0


def child(args: argparse.Namespace) -> None:
    """One variant, one rep, fresh process: peak RSS over the RSS once the inputs exist."""
    logits, ids, mask = make_inputs(args.batch, args.seq, args.vocab, args.mask == "full")
    base = rss_mib()
    run_once(args.variant, args.chunk, logits, ids, mask)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"extra_mib": peak - base}))


MASKS = ("full", "realistic")
VARIANTS = (("naive", None), ("chunked", 32), ("chunked", None), ("chunked", 1024))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant", default=None)
    p.add_argument("--mask", default="full")
    p.add_argument("--chunk", type=int, default=None)
    args = p.parse_args()
    if args.variant:
        return child(args)
    n = args.batch * args.seq * args.vocab
    print(
        f"B={args.batch} S={args.seq} V={args.vocab} bf16 logits on CPU ({torch.get_num_threads()} threads)"
    )
    print(f"logits {2 * n / MIB:.0f} MiB bf16; a full fp32 copy {4 * n / MIB:.0f} MiB; forward + backward;")
    print("the logits' own bf16 gradient (any method needs it) is included in the peak extra memory")
    print(f"{'mask':<10}{'variant':<22}{'tokens':>7}{'median s':>10}{'min s':>8}{'peak extra MiB':>16}")
    # Memory first: a child inherits its parent's RSS high-water mark across fork + exec, so the children
    # must start before this process touches the big tensors.
    extra: dict[tuple[str, int], float] = {}
    for mask_kind in MASKS:
        for i, (variant, chunk) in enumerate(VARIANTS):
            cmd = [sys.executable, __file__, "--variant", variant, "--mask", mask_kind]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab)]
            cmd += ["--chunk", str(chunk)] if chunk else []
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # children import what we import
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            extra[mask_kind, i] = json.loads(out)["extra_mib"]
    for mask_kind in MASKS:
        logits, ids, mask = make_inputs(args.batch, args.seq, args.vocab, mask_kind == "full")
        tokens = int(mask[:, 1:].sum())
        # Timings interleave the variants round by round, so load from other processes hits them alike.
        times: dict[int, list[float]] = {i: [] for i in range(len(VARIANTS))}
        for _ in range(args.reps):
            for i, (variant, chunk) in enumerate(VARIANTS):
                times[i].append(run_once(variant, chunk, logits, ids, mask))
        for i, (variant, chunk) in enumerate(VARIANTS):
            name = variant if variant == "naive" else f"chunked ({chunk or 'auto'} rows)"
            t = sorted(times[i])
            mem = extra[mask_kind, i]
            print(f"{mask_kind:<10}{name:<22}{tokens:>7}{t[len(t) // 2]:>10.3f}{t[0]:>8.3f}{mem:>16.0f}")


if __name__ == "__main__":
    main()
