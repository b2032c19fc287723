"""`coati-kto plan`'s predicted peak per rank against the peak measured on the CPU (live tensor storage).

    PYTHONPATH=. python benchmarks/plan_validation.py [--work DIR] [--lengths 128 512] [--layouts ddp zero2 tp2]
                                                      [--smoke]

A random Llama of ~97M parameters (hidden 768, 12 layers, 12 heads, intermediate 2064, vocabulary 8192), every
example longer than data.max_length (so every row is truncated to it: the plan's bound is the measured case),
micro-batch 4, 2 processes (gloo), the online reference, no checkpointing, sdpa. Layouts:

- ddp: plugin ddp, fp32, dp 2 (torch DDP and its buckets);
- zero2: hybrid_parallel bf16 ZeRO-2, dp 2;
- tp2: hybrid_parallel bf16, tp 2 (one data-parallel rank: ZeRO runs as 0, the AMP optimizer);
- zero2-ckpt, zero2-cached (asked for by name): zero2 with activation checkpointing, and with the cached
  reference (precomputed by the training recipe before its first step, outside the measured steps);
- pp2: hybrid_parallel bf16, pp 2 (1F1B, one data-parallel rank: ZeRO 1 runs as 0, the AMP optimizer), two
  micro-batches a step (train.accumulation_steps 2, the fewest 1F1B runs at pp 2). Each rank is compared with
  the planner's figure for its own stage (``plan_stages``; the rank's stage is its rank in the pp group).

Each rank runs the training recipe through a config (setup_training, build_trainer, KTOTrainer.fit: two
optimizer steps) with ``coati_kto.testing.memory.track_peak`` around every ``_train_step``: baseline (the
storages the step reads or writes that existed before it, and the policy's, reference's and optimizer's
tensors) plus the most bytes made inside it alive at one time. The figure is the larger of the two steps (the
first allocates AdamW's moments). Prints one row per layout, length and rank: predicted, measured, error.
``--smoke``: a Llama of hidden 128 and 2 layers, one length (64), every layout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "ddp": ["plugin.name=ddp", "plugin.precision=fp32", "plugin.zero_stage=0"],
    "zero2": ["plugin.name=hybrid_parallel", "plugin.precision=bf16", "plugin.zero_stage=2"],
    "tp2": [
        "plugin.name=hybrid_parallel",
        "plugin.precision=bf16",
        "plugin.zero_stage=2",
        "plugin.tp_size=2",
    ],
    "pp2": [
        "plugin.name=hybrid_parallel",
        "plugin.precision=bf16",
        "plugin.zero_stage=1",
        "plugin.pp_size=2",
        "train.accumulation_steps=2",
    ],
    "zero2-ckpt": [
        "plugin.name=hybrid_parallel",
        "plugin.precision=bf16",
        "plugin.zero_stage=2",
        "model.gradient_checkpointing=true",
    ],
    "zero2-cached": [
        "plugin.name=hybrid_parallel",
        "plugin.precision=bf16",
        "plugin.zero_stage=2",
        "kto.reference=cached",
    ],
}
DEFAULT_LAYOUTS = ["ddp", "zero2", "tp2", "pp2"]
CONFIG = """model:
  path: {work}/model
  attn_implementation: sdpa
data:
  train_files: [{work}/train.jsonl]
  max_length: {length}
  max_prompt_length: {prompt}
  prepared_dir: {work}/prepared-{length}
train:
  seed: 0
  micro_batch_size: 4
  max_steps: 2
  lr: 1.0e-5
  eval_at_start: false
  eval_at_epoch_end: false
  heartbeat_timeout: 0
output:
  dir: {work}/out
  overwrite: true
  save_interval: 0
logging:
  tensorboard: false
"""


def make_fixture(work: Path, smoke: bool, examples: int = 64) -> int:
    """Tokenizer, random Llama and long JSONL records under ``work`` (``smoke``: a small Llama); returns the
    parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.data.files import write_jsonl
    from coati_kto.testing.tiny import build_tokenizer

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 7))) for _ in range(2000)]
    tokenizer = build_tokenizer([" ".join(rng.sample(words, 200)) for _ in range(300)], vocab_size=8192)
    text = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    records = [{"prompt": text(700), "completion": text(700), "label": i % 2 == 0} for i in range(examples)]
    write_jsonl(records, work / "train.jsonl")
    size = (
        dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4)
        if smoke
        else dict(hidden_size=768, intermediate_size=2064, num_hidden_layers=12, num_attention_heads=12)
    )
    config = LlamaConfig(
        vocab_size=8192, **size,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return sum(p.numel() for p in model.parameters())


def child(config_path: str, overrides: list[str], result: str) -> None:
    """One rank (``run_distributed``: 2 fresh processes, or the test suite's worker ranks): the recipe with the
    tracker around each optimizer step; rank r writes ``result``.r."""
    import torch.distributed as dist

    from coati_kto.config.load import load_config
    from coati_kto.parallel.upstream.noise import quiet_known_warnings
    from coati_kto.recipe.components import build_trainer
    from coati_kto.recipe.plan import predicted_peak_line
    from coati_kto.recipe.setup import setup_training
    from coati_kto.runtime.signals import STOP
    from coati_kto.testing.memory import track_peak
    from coati_kto.trainer.kto import KTOTrainer

    quiet_known_warnings()
    config = load_config(config_path, overrides)
    quiet = contextlib.redirect_stdout(io.StringIO())  # the run's own lines are not the table's
    with quiet:
        run = setup_training(config, None)
        trainer, _ = build_trainer(config, run, STOP.install())
    peaks: list[int] = []
    detail: list[dict] = []
    step = KTOTrainer._train_step

    def tracked(self, *args, **kwargs):
        holders = [m for m in (self.policy, self.reference) if m is not None]
        inner = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO's and the AMP optimizer wrap torch's
        states = [t for s in inner.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
        with track_peak(*holders, *states) as memory:
            step(self, *args, **kwargs)
        peaks.append(memory.peak_bytes)
        top = [[s.nbytes, s.op, list(s.shape), str(s.dtype)] for s in memory.peak_live[:25]]
        detail.append({"baseline": memory.baseline_bytes, "added": memory.peak_added_bytes, "top": top})

    KTOTrainer._train_step = tracked
    if os.environ.get("PLAN_VALIDATION_LIVE"):
        _print_live()
    with quiet:
        trainer.fit(run.train_loader, None, log_dir=None, use_wandb=False)
    rank = dist.get_rank()
    line = predicted_peak_line(config, run.layout.world_size, None)
    stage = dist.get_rank(run.layout.pp_group) if run.layout.pp_group is not None else 0
    record = {"peaks": peaks, "line": line, "detail": detail, "stage": stage}
    Path(f"{result}.{rank}").write_text(json.dumps(record))


def _print_live() -> None:
    """Every CPU tensor storage alive before training, by dtype (a look at what the baseline holds)."""
    import gc

    import torch

    seen: dict[int, tuple[int, str, tuple]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = (storage.nbytes(), str(obj.dtype), tuple(obj.shape))
    by: dict[str, int] = {}
    for nbytes, dtype, _ in seen.values():
        by[dtype] = by.get(dtype, 0) + nbytes
    print("live before training (MiB):", {k: round(v / 2**20, 1) for k, v in by.items()}, flush=True)
    for nbytes, dtype, shape in sorted(seen.values(), reverse=True)[:12]:
        print("   ", round(nbytes / 2**20, 2), dtype, shape, flush=True)


def predicted(config_path: str, overrides: list[str], world: int) -> list[int]:
    """The planner's peak of each pipeline stage, stage 0 first (one figure without pp)."""
    from coati_kto.config.load import load_config
    from coati_kto.parallel.activations import Workload
    from coati_kto.parallel.memory_plan import plan_stages
    from coati_kto.parallel.model_shape import model_shape
    from coati_kto.recipe.plan import configured_layout

    config = load_config(config_path, overrides)
    shape = model_shape(config.model.path)
    work = Workload.from_config(config, "cpu")
    return [plan.peak for plan in plan_stages(shape, configured_layout(config.plugin, world), work)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=list(LAYOUTS))
    parser.add_argument("--smoke", action="store_true", help="a small Llama at one length (64)")
    args = parser.parse_args(argv)
    from coati_kto.cli import main as coati_kto
    from coati_kto.testing.distributed import run_distributed

    work = Path(args.work or tempfile.mkdtemp(prefix="plan_validation_"))
    work.mkdir(parents=True, exist_ok=True)
    lengths = [64] if args.smoke else args.lengths
    if not (work / "model" / "config.json").is_file():
        print(f"fixture: {make_fixture(work, args.smoke):,} parameters in {work}", flush=True)
    print("| layout | max_length | rank | predicted MiB | measured MiB | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    for length in lengths:
        config_path = work / f"config-{length}.yaml"
        config_path.write_text(CONFIG.format(work=work, length=length, prompt=length // 2))
        with contextlib.redirect_stdout(io.StringIO()):  # prepare's report is not this table's
            assert coati_kto(["prepare", str(config_path)]) == 0
        for name in args.layouts:
            overrides = LAYOUTS[name]
            result = work / f"result-{name}-{length}"
            # The figures are tracked tensor bytes (coati_kto.testing.memory), nothing of the process's own: two
            # fresh processes, or the test suite's worker ranks.
            run_distributed(child, 2, str(config_path), overrides, str(result), timeout_s=600)
            wants = predicted(str(config_path), overrides, 2)
            for rank in range(2):
                record = json.loads(Path(f"{result}.{rank}").read_text())
                got, want = max(record["peaks"]), wants[record["stage"]]  # each rank against its own stage
                print(f"| {name} | {length} | {rank} | {want / 2**20:.0f} | {got / 2**20:.0f} | "
                      f"{(want - got) / got:+.1%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
