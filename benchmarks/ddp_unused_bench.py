"""What ``find_unused_parameters`` costs torch DDP per step on a model that uses every parameter, 2 gloo processes.

    python benchmarks/ddp_unused_bench.py [--steps 40 --hidden 64 --layers 2 --micro-batch-size 8 --tokens 192]

The project turns it on only for a policy with trainable parameters one forward leaves unreached
(``coati_kto.parallel.unused``, from ``ParallelPlan.boost``): on, it costs one walk of the autograd graph after each
gradient forward and one used-flag per parameter, read on the host and all-reduced, after each backward; this
measures that cost on a model that would not need it. Both ranks hold two copies of the same
Llama, each boosted by TorchDDPPlugin, one with the flag on and one off, and alternate their steps (forward,
backward, AdamW step), so a shared machine's load falls on both alike. Figures: median process CPU ms and
wall ms per step of each, rank 0's, and the difference. A language-model loss step only: a KTO step adds
no-grad passes (KL pairs, reference) that DDP does not touch, so its relative cost is lower.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from coati_kto.testing.distributed import run_distributed


def _bench(model_dir: str, steps: int, warmup: int, batch: int, tokens: int) -> dict[str, dict[str, float]]:
    from colossalai.booster import Booster
    from colossalai.booster.plugin import TorchDDPPlugin
    from transformers import AutoModelForCausalLM

    from coati_kto.parallel import optimizers

    runs = {}
    for flag in (True, False):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        booster = Booster(plugin=TorchDDPPlugin(broadcast_buffers=False, find_unused_parameters=flag))
        optimizer = optimizers.make_optimizer(model.parameters(), lr=1e-4, weight_decay=0.0)
        model, optimizer, *_ = booster.boost(model, optimizer)
        runs[flag] = (model, optimizer, booster, {"cpu": [], "wall": []})
    gen = torch.Generator().manual_seed(torch.distributed.get_rank())
    vocab = runs[True][0].unwrap().config.vocab_size
    for step in range(warmup + steps):
        ids = torch.randint(3, vocab, (batch, tokens), generator=gen)
        for model, optimizer, booster, times in runs.values():
            cpu, wall = time.process_time(), time.perf_counter()
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            if step >= warmup:
                times["cpu"].append(1000 * (time.process_time() - cpu))
                times["wall"].append(1000 * (time.perf_counter() - wall))
    return {
        "on" if flag else "off": {k: statistics.median(v) for k, v in times.items()}
        for flag, (*_, times) in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each (after warmup)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=192, help="tokens per row")
    parser.add_argument("--smoke", action="store_true", help="3 + 1 steps of 32 tokens (seconds)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.tokens = 3, 1, 32

    from coati_kto.testing.tiny import save_tiny_model

    corpus = ["The capital of France is Paris. Please add 2 and 3. The answer is 5."] * 50
    with tempfile.TemporaryDirectory(prefix="ddp_unused_bench_") as work:
        model_dir = save_tiny_model(
            Path(work) / "tiny", corpus, hidden_size=args.hidden, num_layers=args.layers
        )
        ranks = run_distributed(
            _bench, 2, str(model_dir), args.steps, args.warmup, args.micro_batch_size, args.tokens
        )
    on, off = ranks[0]["on"], ranks[0]["off"]
    print(
        f"Llama hidden {args.hidden}, {args.layers} layers, 2 processes, micro-batch {args.micro_batch_size} x "
        f"{args.tokens} tokens, median of {args.steps} steps after {args.warmup}, rank 0\n"
    )
    print("| find_unused_parameters | step CPU ms | step wall ms |")
    print("|---|---|---|")
    for name, figures in (("on", on), ("off", off)):
        print(f"| {name} | {figures['cpu']:.2f} | {figures['wall']:.2f} |")
    cpu, wall = on["cpu"] - off["cpu"], on["wall"] - off["wall"]
    print(
        f"| on - off | {cpu:+.2f} ({100 * cpu / off['cpu']:+.1f}%) | {wall:+.2f} ({100 * wall / off['wall']:+.1f}%) |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
