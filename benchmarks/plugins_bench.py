"""KTO optimizer-step time and peak RSS per rank for each ColossalAI plugin that runs on CPU, 2 gloo processes.

    python benchmarks/plugins_bench.py [--steps 20 --warmup 5 --micro-batch-size 8 --prompt 96 --completion 96]

Each plugin runs in its own fresh pair of processes (ru_maxrss is a process-lifetime high-water mark), on the
tiny Llama of coati_kto.testing.tiny (hidden 64, 2 layers), with KTOTrainer doing the real step: KL passes, reference
passes, loss pass with backward, one metric all-reduce, optimizer step. Step time: median over the steps after
``--warmup``, measured on every rank (the table shows rank 0's and the slower rank's medians). The machine may
be shared: compare rows of one run, not runs across machines.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This script, or a rank it spawned (__mp_main__): this runs before the rank's imports.
if __name__ in ("__main__", "__mp_main__"):
    from coati_kto.runtime.startup import hold_collection

    hold_collection()  # the collector off through the imports, as in a `coati-kto` process (main, _worker release it)

PLUGINS = {
    "hybrid zero2 bf16": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    "hybrid zero0 fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
    "low_level_zero 2 bf16": {"name": "low_level_zero", "zero_stage": 2, "precision": "bf16"},
    "ddp fp32": {"name": "ddp", "zero_stage": 0, "precision": "fp32"},
    "hybrid tp2 fp32": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32", "tp_size": 2},
}


def _batches(n: int, micro_batch_size: int, prompt: int, completion: int, vocab: int, seed: int) -> list:
    """Random KTOBatch micro-batches; half desirable, right-padded completions of varying length."""
    import torch

    from coati_kto.data.collator import KTOCollator

    gen = torch.Generator().manual_seed(seed)
    collate = KTOCollator(pad_token_id=0)
    out = []
    for _ in range(n):
        rows = []
        for i in range(micro_batch_size):
            p = torch.randint(3, vocab, (prompt,), generator=gen).tolist()
            c = int(torch.randint(completion // 2, completion + 1, (1,), generator=gen))
            rows.append(
                {
                    "input_ids": p + torch.randint(3, vocab, (c,), generator=gen).tolist(),
                    "completion_start": prompt,
                    "label": i % 2 == 0,
                    "kl_input_ids": p + torch.randint(3, vocab, (c,), generator=gen).tolist(),
                    "kl_completion_start": prompt,
                }
            )
        out.append(collate(rows))
    return out


def _worker(model_dir: str, out_dir: str, plugin: dict, args: dict) -> dict:
    import torch.distributed as dist

    from coati_kto.config.schema import Config
    from coati_kto.parallel.plan import ParallelPlan
    from coati_kto.recipe.components import build_components
    from coati_kto.runtime.startup import release_collection
    from coati_kto.trainer.kto import KTOTrainer

    release_collection()  # a spawned rank's imports are done (the top of this file held the collector)

    class TimedTrainer(KTOTrainer):
        def _train_step(self, micro_batches, epoch):
            start = time.perf_counter()
            super()._train_step(micro_batches, epoch)
            self.step_times.append(time.perf_counter() - start)

    cfg = Config.model_validate(
        {
            "model": {"path": model_dir},
            "data": {"train_files": ["unused"], "prepared_dir": "unused"},
            "output": {"dir": out_dir},  # the config needs one; the trainer writes nothing (no checkpoints)
            "train": {"lr": 1e-4, "micro_batch_size": args["micro_batch_size"]},
            "plugin": plugin,
        }
    )
    total = args["steps"] + args["warmup"]
    plan = ParallelPlan.from_config(cfg)
    built = plan.backend.build_plugin()
    parts = build_components(cfg, built, total, plan)
    trainer = TimedTrainer(
        parts.policy, parts.reference, parts.booster, parts.optimizer, built, parts.lr_scheduler, None,
        layout=parts.layout, plan=plan,
    )  # fmt: skip
    trainer.step_times = []
    vocab = parts.policy.unwrap().config.vocab_size - 1
    # Tensor-parallel ranks of one data-parallel group get the same batches: seed by dp rank.
    loader = _batches(
        total, args["micro_batch_size"], args["prompt"], args["completion"], vocab, seed=parts.layout.dp_rank
    )
    dist.barrier()
    trainer.fit(loader)
    times = trainer.step_times[args["warmup"] :]
    return {
        "median_ms": 1000 * statistics.median(times),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": [h["train/loss"] for h in trainer.history if "train/loss" in h][-1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after warmup)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens per example")
    parser.add_argument("--completion", type=int, default=96, help="max completion tokens (min: half)")
    parser.add_argument("--only", nargs="*", default=None, help="plugin rows to run (default: all)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="2 + 1 steps of 16 + 16 tokens, hybrid ZeRO-2 bf16 only (seconds)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.prompt, args.completion = 2, 1, 16, 16
        args.only = args.only or ["hybrid zero2 bf16"]

    from coati_kto.runtime.startup import release_collection
    from coati_kto.testing.tiny import save_tiny_model

    release_collection()  # the imports are done (see the end of this file)
    corpus = ["The capital of France is Paris. Please add 2 and 3. The answer is 5."] * 50
    with tempfile.TemporaryDirectory(prefix="plugins_bench_") as work:
        return _table(args, save_tiny_model(Path(work) / "tiny", corpus), Path(work) / "out")


def _table(args: argparse.Namespace, model_dir: Path, out_dir: Path) -> int:
    """Runs every selected plugin row on 2 ranks and prints the table; 0."""
    from coati_kto.testing.distributed import run_distributed

    settings = {k: getattr(args, k) for k in ("steps", "warmup", "micro_batch_size", "prompt", "completion")}
    print(
        f"tiny Llama (hidden 64, 2 layers), 2 processes, micro-batch {args.micro_batch_size}, "
        f"{args.prompt} prompt + {args.completion // 2}-{args.completion} completion tokens, "
        f"median of {args.steps} steps after {args.warmup}\n"
    )
    header = f"| {'plugin':<22} | step ms (rank 0) | step ms (slowest rank) | peak RSS MiB/rank | last loss |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, plugin in PLUGINS.items():
        if args.only and name not in args.only:
            continue
        try:
            res = run_distributed(_worker, 2, str(model_dir), str(out_dir), plugin, settings)
        except RuntimeError as err:
            print(f"| {name:<22} | failed: {str(err).splitlines()[-1][:80]} |")
            continue
        slowest = max(r["median_ms"] for r in res)
        rss = "/".join(f"{r['peak_rss_mib']:.0f}" for r in res)
        print(
            f"| {name:<22} | {res[0]['median_ms']:16.1f} | {slowest:22.1f} | {rss:>17} | "
            f"{res[0]['loss']:9.4f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
