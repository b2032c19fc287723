"""Helpers shared by test folders: the tiny tokenizer's corpus, a minimal config, preference records."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

# The tiny tokenizer's training text (conftest builds the tiny Llama and its ChatML BPE tokenizer from it).
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Please add 2 and 3. The answer is 5. Thank you for asking!",
    "def add(a, b):\n    return a + b\n",
    "I cannot help with that. Sorry, that is not possible.",
    "Call the tool search with query weather in Berlin and report the result.",
] * 20

# A config that validates without touching the disk (the model path is a hub-style id).
MINIMAL = """\
model:
  path: some/model
data:
  train_files: data.jsonl
  prepared_dir: prepared
output:
  dir: out
"""

# A config for ``coati-kto plan`` on a model directory: ``PLAN_CONFIG.format(model=...)``.
PLAN_CONFIG = """\
model:
  path: {model}
data:
  train_files: data.jsonl
  prepared_dir: prepared
  max_length: 64
output:
  dir: out
"""


def write_config(tmp_path: Path, text: str) -> Path:
    """``text`` written to ``tmp_path/cfg.yaml``."""
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


# Desirable: helpful answers; undesirable: refusals. Built from the tiny tokenizer's corpus (tests/conftest.py).
QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("Please add 2 and 3.", "The answer is 5. Thank you for asking!"),
    ("Write a function that adds two numbers.", "def add(a, b):\n    return a + b\n"),
    (
        "What is the weather in Berlin?",
        "Call the tool search with query weather in Berlin and report the result.",
    ),
]
REFUSALS = ["I cannot help with that.", "Sorry, that is not possible.", "I cannot help with that. Sorry!"]


def preference_records(
    n: int, offset: int, questions: int = len(QUESTIONS), refusals: int = len(REFUSALS)
) -> list[dict]:
    """Imbalanced (about 2 desirable : 1 undesirable), each prompt with both kinds of answer; from the first
    ``questions`` questions and ``refusals`` refusals."""
    out = []
    for i in range(n):
        question, answer = QUESTIONS[(i + offset) % questions]
        desirable = i % 3 != 2
        completion = answer if desirable else REFUSALS[i % refusals]
        out.append({"prompt": f"{question} ({i + offset})", "completion": completion, "label": desirable})
    return out


# A 2-rank CLI run (operations and drills): the data, its config, its environment and its final weights.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Please add 2 and 3.",
    "Write a function that adds numbers.",
]
CHAT_ANSWERS = ["The capital of France is Paris.", "The answer is 5.", "def add(a, b): return a + b"]


def chat_records(
    n: int, refusal: str, offset: int = 0, answers: list[str] = CHAT_ANSWERS
) -> list[dict[str, Any]]:
    """``n`` two-turn conversations (records ``offset`` to ``offset + n``), two desirable answers to one
    ``refusal`` (undesirable)."""
    out = []
    for i in range(offset, offset + n):
        desirable = i % 3 != 2
        messages = [
            {"role": "user", "content": f"{CHAT_QUESTIONS[i % 3]} ({i})"},
            {"role": "assistant", "content": answers[i % 3] if desirable else refusal},
        ]
        out.append({"messages": messages, "label": desirable})
    return out


GOOD = ["Paris is the capital.", "The answer is 5.", "Here is the result, thank you!"]
BAD = ["I cannot help with that.", "Sorry, that is not possible."]


def write_run(root: Path, model_dir: Path, steps: int = 48, save_interval: int = 4) -> Path:
    """96 examples (3:1), 2 ranks x micro-batch 2: 24 steps per epoch; ``steps`` steps in all. Prepared."""
    rng = random.Random(0)
    data = root / "train.jsonl"
    with data.open("w") as f:
        for i in range(96):
            label = i % 4 != 0
            completion = rng.choice(GOOD if label else BAD)
            f.write(
                json.dumps(
                    {"prompt": f"Question {i}: please answer.", "completion": completion, "label": label}
                )
            )
            f.write("\n")
    config = root / "config.yaml"
    config.write_text(
        f"""
model:
  path: {model_dir}
data:
  train_files: [{data}]
  prepared_dir: {root / "prepared"}
  max_length: 64
  max_prompt_length: 32
train:
  seed: 7
  micro_batch_size: 2
  max_epochs: 2
  max_steps: {steps}
  lr: 1.0e-3
plugin:
  name: hybrid_parallel
  zero_stage: 2
  precision: bf16
output:
  dir: {root / "out"}
  save_interval: {save_interval}
logging:
  tensorboard: true
"""
    )
    # `coati-kto prepare` is the CLI's code path, nothing a launched process adds: on a worker rank (run_cli), not a
    # new interpreter's 5 CPU-s of imports. Every caller runs under pytest, where the worker pool is on.
    from coati_kto.testing.cli import run_cli

    prepared = run_cli(["prepare", str(config)])
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    return config


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(out_dir / "final" / "model.safetensors")


def data_settings(config: Any) -> tuple[Any, Any]:
    """What the CLI and the recipe hand the data package for ``config`` (a ``Config``): its
    ``PrepareSettings`` and ``WeightSettings``, as ``prepare(*data_settings(config))`` takes them."""
    from coati_kto.data.settings import PrepareSettings
    from coati_kto.data.weights import WeightSettings

    return (
        PrepareSettings(config.data, config.model, config.train.seed),
        WeightSettings(config.kto, config.train.micro_batch_size),
    )


def step_all(*optimizers: torch.optim.Optimizer) -> None:
    """One step of each optimizer, then zero its gradients (a sharded run and the one-process run it is held to)."""
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def weight_diffs(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """The largest absolute difference of each tensor ``trained`` shares with ``expected``, by name."""
    return {k: float((trained[k] - v).abs().max()) for k, v in expected.items() if k in trained}


def hub_cache_config(root: Path, repo: str, raw: dict, monkeypatch: Any) -> None:
    """``repo``'s config.json (``raw``) in a hub cache at ``root`` that huggingface_hub reads (its HF_HUB_CACHE
    patched through ``monkeypatch``), as ``hf download repo config.json`` leaves it."""
    from huggingface_hub import constants

    folder = root / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(raw))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))


# SmolLM2-135M's config.json shape (a Llama): 9 query over 3 key-value heads, which neither tp 2 nor sp 2 splits.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
