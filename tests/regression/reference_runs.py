"""Reference runs: "same seed, same numbers" is the proof that a refactor changed nothing (torchtitan's habit).

Four fixed-seed runs of ``coati_kto.train.train`` on 2 gloo processes, each 4 optimizer steps of a tiny Llama
with an evaluation at step 0 and at the end:

- ``ddp_fp32``: TorchDDPPlugin, fp32, online reference, accumulation 2;
- ``hybrid_zero2_bf16``: HybridParallelPlugin ZeRO-2 bf16 (the default plugin), online reference;
- ``cached_reference``: low_level_zero ZeRO-2 fp32 with ``kto.reference: cached`` (the policy packs);
- ``lora``: hybrid ZeRO-0 fp32 with LoRA adapters (the reference is the policy with adapters off).

For each run the file ``reference_runs.json`` holds every logged number except timings (per-step loss,
rewards, KL, grad norm, LR, counts; eval metrics) and a SHA-256 of the exported weights (``final/``).

Regenerate (only when a change is *meant* to alter the numbers, and say so in the commit)::

    .venv/bin/python tests/regression/reference_runs.py --write

The test (``tests/regression/test_reference_runs.py``) compares a fresh run bit for bit only where the reference
was recorded on the same kernels: same torch and transformers, CPU vendor and model, the ISA extensions MKL and
oneDNN dispatch on, thread count and kernel-capping environment (``coati_kto.testing.machine.kernel_key``; the
file's "machine" says where it was recorded). Elsewhere float results legitimately differ in the last bits, so it
compares within fp32/bf16 rounding instead, and prints which path it took and why.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REFERENCE_FILE = HERE / "reference_runs.json"
sys.path.insert(0, str(HERE.parent))  # tests/: conftest (the tiny corpus)

STEPS = 4
# Keys that are timings or machine-dependent rates, never compared.
TIMING_MARKERS = ("per_second", "mfu", "seconds", "time", "flops")

RUNS: dict[str, dict[str, Any]] = {
    "ddp_fp32": {
        "plugin": {"name": "ddp", "precision": "fp32"},
        "train": {"accumulation_steps": 2},
    },
    "hybrid_zero2_bf16": {
        "plugin": {"name": "hybrid_parallel", "zero_stage": 2, "precision": "bf16"},
    },
    "cached_reference": {
        "plugin": {"name": "low_level_zero", "zero_stage": 2, "precision": "fp32"},
        "kto": {"reference": "cached"},
    },
    "lora": {
        "plugin": {"name": "hybrid_parallel", "zero_stage": 0, "precision": "fp32"},
        "model": {"lora": {"rank": 4, "alpha": 8}},
        "train": {"lr": 2e-2},
    },
}


def _records(n: int, offset: int) -> list[dict]:
    """The records the reference was recorded with: the first 4 questions and 2 refusals of tests/helpers.py."""
    from helpers import preference_records

    return preference_records(n, offset, questions=4, refusals=2)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def write_config(name: str, root: Path, model_dir: Path) -> Path:
    """The YAML of run ``name`` under ``root`` (data files written beside it)."""
    from coati_kto.data.files import write_jsonl

    base = {
        "model": {"path": str(model_dir)},
        "data": {
            "train_files": [str(write_jsonl(_records(40, 0), root / "train.jsonl"))],
            "eval_files": [str(write_jsonl(_records(7, 100), root / "eval.jsonl"))],
            "prepared_dir": str(root / "prepared"),
            "max_length": 64,
            "max_prompt_length": 32,
        },
        "kto": {"beta": 0.1},
        "train": {
            "seed": 7,
            "micro_batch_size": 4,
            "accumulation_steps": 1,
            "max_epochs": 3,
            "max_steps": STEPS,
            "lr": 5e-3,
            "warmup_steps": 1,
            "eval_interval": STEPS,
        },
        "output": {"dir": str(root / f"out-{name}"), "save_interval": 0},
        "logging": {"tensorboard": False, "wandb": False},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_merge(base, RUNS[name])))
    return path


def _train_worker(config_path: str) -> dict:
    from coati_kto.config.load import load_config
    from coati_kto.train import train

    trainer = train(load_config(config_path, []))
    history = [
        {k: v for k, v in record.items() if not any(m in k for m in TIMING_MARKERS)}
        for record in trainer.history
    ]
    return {"history": history}


def weights_digest(final_dir: Path) -> dict[str, Any]:
    """SHA-256 over every exported tensor (sorted by name, dtype and shape included) and their fp64 sum."""
    import torch
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    total = 0.0
    files = sorted(final_dir.rglob("*.safetensors"))
    assert files, f"no safetensors under {final_dir}"
    for file in files:
        tensors = load_file(file)
        for key in sorted(tensors):
            t = tensors[key].contiguous()
            digest.update(f"{file.relative_to(final_dir)}:{key}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
            total += float(t.double().sum())
    return {"sha256": digest.hexdigest(), "sum": total}


def machine() -> dict[str, Any]:
    """What picks the kernels of the recorded runs (``coati_kto.testing.machine``): the ranks run one thread each."""
    from coati_kto.testing.machine import kernel_key

    return kernel_key(threads=1)


def run_reference(name: str, root: Path, model_dir: Path) -> dict[str, Any]:
    """Run ``name`` on 2 processes; its history (rank 0, equal on both ranks) and exported-weights digest."""
    from coati_kto.testing.distributed import run_distributed

    root.mkdir(parents=True, exist_ok=True)
    config = write_config(name, root, model_dir)
    results = run_distributed(_train_worker, 2, str(config))
    assert results[0]["history"] == results[1]["history"], f"{name}: ranks logged different numbers"
    return {"history": results[0]["history"], "weights": weights_digest(root / f"out-{name}" / "final")}


def build_model(root: Path) -> Path:
    from conftest import CORPUS

    from coati_kto.testing.tiny import save_tiny_model

    return save_tiny_model(root / "tiny_llama", CORPUS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE_FILE.name}")
    parser.add_argument("runs", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_model(root)
        out = {"machine": machine(), "runs": {}}
        for name in args.runs:
            out["runs"][name] = run_reference(name, root / name, model_dir)
            print(name, json.dumps(out["runs"][name]["weights"]), flush=True)
    if args.write:
        REFERENCE_FILE.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {REFERENCE_FILE}")
    else:
        print(json.dumps(out, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
