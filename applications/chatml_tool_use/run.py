"""Recipe 2, end to end on CPU: the seeds' data shape (ChatML tool use, 746:254) trained with all data kept.

1. data      make_data.py: 1000 synthetic conversations, 746 desirable : 254 undesirable (+ 100 for eval)
2. base      a tiny random Llama and a BPE tokenizer with a ChatML template (swap in a real model for real use)
3. prepare   coati-kto prepare configs/chatml_tool_use_cpu.yaml
4. inspect   coati-kto inspect configs/chatml_tool_use_cpu.yaml --ranks 2   (every micro-batch holds both labels)
5. kto       colossalai run --nproc_per_node 2 -m coati_kto train configs/chatml_tool_use_cpu.yaml

Everything lands in outputs/chatml_tool_use/ (removed first). Extra section.key=value arguments go to the
config, e.g. ``data.train_files=[syngen_toolset_v1.0.0_claude.jsonl]`` (see applications/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path("outputs/chatml_tool_use")
CONFIG = "configs/chatml_tool_use_cpu.yaml"
BIN = Path(sys.executable).parent  # colossalai/torchrun of this interpreter's environment, not PATH's


def sh(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """Run a command from the repo root, echoing it; stop the recipe if it fails."""
    print("$ " + " ".join(cmd), flush=True)
    if (code := subprocess.call(cmd, cwd=ROOT, env=env)) != 0:
        sys.exit(f"command failed with exit status {code}: {' '.join(cmd)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="section.key=value for the config")
    args = parser.parse_args()
    os.chdir(ROOT)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_data import make_records, write_jsonl

    from coati_kto.parallel.distributed import free_port
    from coati_kto.parallel.launch_env import launcher_env
    from coati_kto.testing.tiny import build_llama, build_tokenizer

    begin = time.perf_counter()
    shutil.rmtree(OUT, ignore_errors=True)
    train, held_out = make_records(seed=0), make_records(seed=1, n_desirable=75, n_undesirable=25)
    write_jsonl(train, OUT / "data" / "train.jsonl")
    write_jsonl(held_out, OUT / "data" / "eval.jsonl")
    print(
        f"[data] {OUT}/data/train.jsonl: {sum(r['label'] for r in train)} desirable : "
        f"{sum(not r['label'] for r in train)} undesirable; first record:"
    )
    print(json.dumps(train[0], indent=1)[:1200] + "\n ...")

    corpus = [m["content"] for r in train for m in r["messages"]] + ["system", "user", "assistant", "tool"]
    tokenizer = build_tokenizer(corpus, vocab_size=1024)
    model = build_llama(tokenizer, hidden_size=64, num_layers=2, num_heads=4, max_positions=1024, seed=0)
    model.save_pretrained(OUT / "base")
    tokenizer.save_pretrained(OUT / "base")
    print(f"[base] {OUT}/base: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter Llama")

    sh([sys.executable, "-m", "coati_kto", "prepare", CONFIG, *args.overrides])
    inspect = [sys.executable, "-m", "coati_kto", "inspect", CONFIG, *args.overrides]
    sh([*inspect, "--ranks", "2", "--batches", "3"])  # what each rank's micro-batches hold
    # One thread per rank: two ranks on two cores. colossalai run calls `torchrun` through the shell.
    env = launcher_env(BIN, threads=1)  # also leaves out variables colossalai run cannot quote
    launch = [str(BIN / "colossalai"), "run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    sh([*launch, "-m", "coati_kto", "train", CONFIG, *args.overrides], env=env)

    print(f"\ntotal wall time {time.perf_counter() - begin:.0f}s; the trained model: {OUT}/kto/final")
    tensorboard = BIN / "tensorboard"
    if tensorboard.is_relative_to(ROOT):  # .venv/bin/tensorboard
        tensorboard = tensorboard.relative_to(ROOT)
    print(f"TensorBoard: {tensorboard} --logdir {OUT}/kto/tensorboard")


if __name__ == "__main__":
    main()
