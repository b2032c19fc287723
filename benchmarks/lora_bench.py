"""Peak memory (RSS) of LoRA KTO against full fine-tuning, 1 process, a few steps.

    PYTHONPATH=. python benchmarks/lora_bench.py [--hidden 512] [--layers 8] [--steps 3]

Fixture: a random Llama (default hidden 512, 8 layers, vocabulary 8192: about 34M parameters) saved in fp32,
about 100 + 60 tokens per example, micro-batch 4, ddp fp32, 1 process. Each run is a whole training process
(the parent imports nothing heavy), so each child's ``ru_maxrss`` is its own peak; the cyclic collector is off
through a child's imports, as in a ``coati-kto`` process (coati_kto.runtime.startup):

- full: every weight trained, AdamW states for all of them, and the reference model (a second copy, loaded
  from the same safetensors file: its pages are mmapped, so part of it may be shared with the policy's);
- lora: adapters (rank 8 on q/k/v/o) trained, AdamW states for them only, the reference is the policy with
  the adapters disabled (no second copy).

Prints one line per run (peak RSS, trainable parameters, seconds) and the difference. Not a test: figures
depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup(work: Path, hidden: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from coati_kto.data.files import write_jsonl
    from coati_kto.runtime.startup import release_collection
    from coati_kto.testing.tiny import build_tokenizer

    release_collection()  # the imports are done (main held the collector)
    rng = random.Random(0)
    words = [f"w{i}" for i in range(2000)]
    records = []
    for i in range(64):
        prompt = " ".join(rng.choice(words) for _ in range(100))
        completion = " ".join(rng.choice(words) for _ in range(60))
        records.append({"prompt": prompt, "completion": completion, "label": i % 3 != 2})
    corpus = [r["prompt"] + " " + r["completion"] for r in records]
    tokenizer = build_tokenizer(corpus, vocab_size=8192)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(work / "model", safe_serialization=True)
    tokenizer.save_pretrained(work / "model")
    write_jsonl(records, work / "train.jsonl")
    print(json.dumps({"params": sum(p.numel() for p in model.parameters())}))


def _child(work: Path, mode: str, steps: int) -> None:
    import yaml

    from coati_kto.config.schema import Config
    from coati_kto.train import train

    raw = {
        "model": {"path": str(work / "model")},
        "data": {
            "train_files": [str(work / "train.jsonl")],
            "prepared_dir": str(work / "prepared"),
            "max_length": 192,
            "max_prompt_length": 128,
        },
        "train": {"micro_batch_size": 4, "max_steps": steps, "lr": 1e-4, "eval_at_start": False},
        "plugin": {"name": "ddp"},
        "output": {"dir": str(work / f"out-{mode}"), "save_final": False, "overwrite": True},
        "logging": {"tensorboard": False},
    }
    if mode == "lora":
        raw["model"]["lora"] = {"rank": 8, "alpha": 16}
    started = time.perf_counter()
    trainer = train(Config.model_validate(yaml.safe_load(yaml.safe_dump(raw))))
    trainable = sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps({"peak_rss_mib": peak, "trainable": trainable, "seconds": time.perf_counter() - started})
    )


def _run(args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(
        [sys.executable, __file__, *args], env=env, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        sys.exit(f"child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--child", choices=["setup", "full", "lora"])
    parser.add_argument("--work")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, seconds: the figures of every row, for tests/e2e/test_benchmarks.py",
    )
    args = parser.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.steps = 64, 2, 2
    if args.child:
        from coati_kto.runtime.startup import hold_collection

        hold_collection()  # as the `coati-kto` entry point; train() (setup: after its imports) releases it
    if args.child == "setup":
        return _setup(Path(args.work), args.hidden, args.layers)
    if args.child:
        return _child(Path(args.work), args.child, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        base = ["--work", tmp, "--hidden", str(args.hidden), "--layers", str(args.layers)]
        params = _run(["--child", "setup", *base])["params"]
        print(
            f"random Llama: {params / 1e6:.1f}M parameters (fp32 {params * 4 / 2**20:.0f} MiB), ddp fp32, 1 process"
        )
        runs = {mode: _run(["--child", mode, *base, "--steps", str(args.steps)]) for mode in ("full", "lora")}
    for mode, r in runs.items():
        print(
            f"{mode:>4}: peak RSS {r['peak_rss_mib']:.0f} MiB, trainable {r['trainable'] / 1e6:.2f}M, "
            f"{r['seconds']:.1f} s for {args.steps} steps"
        )
    saved = runs["full"]["peak_rss_mib"] - runs["lora"]["peak_rss_mib"]
    print(
        f"lora saves {saved:.0f} MiB peak RSS ({saved / runs['full']['peak_rss_mib']:.0%} of full fine-tuning)"
    )


if __name__ == "__main__":
    main()
