"""Naive fp32 log_softmax vs chunked sequence_logps: time and peak extra memory, on CPU.

    PYTHONPATH=. python benchmarks/logprobs_bench.py [--batch 8 --seq 512 --vocab 32000 --reps 3]
    PYTHONPATH=. python benchmarks/logprobs_bench.py --head [--batch 4 --seq 2048 --vocab 128000 --hidden 1024]
    PYTHONPATH=. python benchmarks/logprobs_bench.py --head-chunks [--batch 8 --seq 102 --vocab 8192 --hidden 256]

``--head`` compares, from the last hidden states on, the LM head + logits path (what the trainer did before:
[B, K, V] logits from ``logits_to_keep``, then sequence_logps) with the chunked head (hidden_sequence_logps: no
logits tensor), forward + backward (gradients for the hidden states and the head weight), bf16.
``--head-chunks``: the chunked head alone, fp32, at fp32 blocks of 1 to 32 MiB per vocabulary chunk (what set
its CPU default: 32 MiB), with freed host memory kept as ``coati-kto train`` keeps it
(``coati_kto.runtime.host_memory``); ``--glibc-default`` leaves glibc's settings, under which every block above
its mmap threshold is faulted in afresh each time (what had set the default to 2 MiB before).

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

from coati_kto.models.logprobs import completion_logits_to_keep, hidden_sequence_logps, sequence_logps

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


def head_inputs(args: argparse.Namespace):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.batch, args.seq, args.hidden, generator=g).bfloat16()
    weight = (torch.randn(args.vocab, args.hidden, generator=g) / args.hidden**0.5).bfloat16()
    _, ids, mask = make_inputs(args.batch, args.seq, 2, full_mask=args.mask == "full")
    ids = torch.randint(0, args.vocab, ids.shape, generator=g)
    return hidden, weight, ids, mask


def run_head(variant: str, hidden, weight, ids, mask) -> tuple[float, torch.Tensor]:
    keep = completion_logits_to_keep(mask)
    h = hidden[:, -keep:].detach().requires_grad_()
    w = weight.detach().requires_grad_()
    t0 = time.perf_counter()
    if variant == "logits":
        out = sequence_logps(torch.nn.functional.linear(h, w), ids, mask)
    else:
        out = hidden_sequence_logps(h, w, None, ids, mask)
    out.sum().backward()
    return time.perf_counter() - t0, out.detach()


def head_child(args: argparse.Namespace) -> None:
    inputs = head_inputs(args)
    base = rss_mib()
    seconds, out = run_head(args.variant, *inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"extra_mib": peak - base, "seconds": seconds, "logps": out.tolist()}))


def head_main(args: argparse.Namespace) -> None:
    print(
        f"B={args.batch} S={args.seq} V={args.vocab} H={args.hidden} bf16, {args.mask} mask, forward + backward "
        f"(grads of hidden states and head weight); each variant in its own process ({torch.get_num_threads()} "
        "threads)"
    )
    n = args.batch * args.seq * args.vocab
    print(
        f"full logits would be {2 * n / MIB:.0f} MiB bf16; the head weight {2 * args.vocab * args.hidden / MIB:.0f} MiB"
    )
    results = {}
    for variant in ("logits", "chunked"):
        cmd = [sys.executable, __file__, "--head", "--variant", variant, "--mask", args.mask]
        cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab)]
        cmd += ["--hidden", str(args.hidden)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results[variant] = json.loads(out)
    for variant, r in results.items():
        print(f"{variant:<10} peak extra {r['extra_mib']:8.0f} MiB   {r['seconds']:9.4f} s")
    ratio = results["chunked"]["extra_mib"] / results["logits"]["extra_mib"]
    diff = max(
        abs(a - b) for a, b in zip(results["chunked"]["logps"], results["logits"]["logps"], strict=True)
    )
    print(
        f"chunked / logits peak extra memory: {ratio:.3f} (target <= 0.25); max |logps diff| {diff:.2e} nats"
    )


def head_chunks_main(args: argparse.Namespace) -> None:
    """The chunked head's time per vocabulary chunk size: forward alone and forward + backward, fp32, on
    [positions, hidden] x [vocab, hidden], each chunk size set as a block of positions x columns elements."""
    from coati_kto.models.logprobs import _vocab_chunk, head_token_logps
    from coati_kto.runtime.host_memory import keep_freed_memory

    if args.glibc_default:
        malloc = "glibc default malloc settings"
    else:  # as train runs; None where the C library is not glibc
        malloc = "freed memory kept" if keep_freed_memory() else "not glibc"
    torch.manual_seed(0)
    positions = args.batch * args.seq
    hidden = torch.randn(positions, args.hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (positions,))
    default = _vocab_chunk(positions, args.vocab, None, hidden.device)
    blocks = [1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23]
    chunks = {f"{b * 4 // MIB} MiB": max(1, b // positions) for b in blocks}

    def run(chunk: int, grad: bool) -> float:
        start = time.process_time()
        if grad:
            head_token_logps(hidden, weight, None, targets, vocab_chunk=chunk).sum().backward()
        else:
            with torch.no_grad():
                head_token_logps(hidden, weight, None, targets, vocab_chunk=chunk)
        return time.process_time() - start

    print(
        f"chunked head, fp32, {positions} positions x hidden {args.hidden} x vocabulary {args.vocab}, "
        f"{torch.get_num_threads()} thread(s); default chunk on CPU: {default} columns; {malloc}"
    )
    print(f"{'fp32 block':<12}{'columns':>8}{'forward ms':>12}{'fwd+bwd ms':>12}")
    times: dict[str, list[list[float]]] = {name: [[], []] for name in chunks}
    for _ in range(args.reps):  # interleaved round by round: load from other processes hits them alike
        for name, chunk in chunks.items():
            for grad in (False, True):
                times[name][grad].append(run(chunk, grad))
    for name, chunk in chunks.items():
        fwd, both = (sorted(t)[len(t) // 2] * 1e3 for t in times[name])
        print(f"{name:<12}{min(chunk, args.vocab):>8}{fwd:>12.1f}{both:>12.1f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head", action="store_true", help="LM head from hidden states: logits vs chunked")
    p.add_argument(
        "--head-chunks", action="store_true", help="the chunked head's time per vocabulary chunk size (fp32)"
    )
    p.add_argument(
        "--glibc-default",
        action="store_true",
        help="with --head-chunks: glibc's malloc settings, not train's",
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variant", default=None)
    p.add_argument("--mask", default="full")
    p.add_argument("--chunk", type=int, default=None)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds: the figures of every row, for tests/e2e/test_benchmarks.py",
    )
    args = p.parse_args()
    if args.smoke:  # tiny tensors
        args.batch, args.seq, args.vocab, args.hidden, args.reps = 2, 32, 512, 32, 1
    if args.head_chunks:
        return head_chunks_main(args)
    if args.head:
        if args.variant:
            return head_child(args)
        return head_main(args)
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
    # Smoke: one mask, the naive and one chunked variant (each memory child costs a torch import).
    masks = MASKS[1:] if args.smoke else MASKS
    chosen = [0, 1] if args.smoke else list(range(len(VARIANTS)))
    extra: dict[tuple[str, int], float] = {}
    for mask_kind in masks:
        for i in chosen:
            variant, chunk = VARIANTS[i]
            cmd = [sys.executable, __file__, "--variant", variant, "--mask", mask_kind]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab)]
            cmd += ["--chunk", str(chunk)] if chunk else []
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # children import what we import
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            extra[mask_kind, i] = json.loads(out)["extra_mib"]
    for mask_kind in masks:
        logits, ids, mask = make_inputs(args.batch, args.seq, args.vocab, mask_kind == "full")
        tokens = int(mask[:, 1:].sum())
        # Timings interleave the variants round by round, so load from other processes hits them alike.
        times: dict[int, list[float]] = {i: [] for i in chosen}
        for _ in range(args.reps):
            for i in chosen:
                variant, chunk = VARIANTS[i]
                times[i].append(run_once(variant, chunk, logits, ids, mask))
        for i in chosen:
            variant, chunk = VARIANTS[i]
            name = variant if variant == "naive" else f"chunked ({chunk or 'auto'} rows)"
            t = sorted(times[i])
            mem = extra[mask_kind, i]
            print(f"{mask_kind:<10}{name:<22}{tokens:>7}{t[len(t) // 2]:>10.3f}{t[0]:>8.3f}{mem:>16.0f}")


if __name__ == "__main__":
    main()
