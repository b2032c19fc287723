"""Helpers shared by test folders: the tiny tokenizer's corpus, a minimal config, preference records."""

from __future__ import annotations

from pathlib import Path

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


def preference_records(n: int, offset: int) -> list[dict]:
    """Imbalanced (about 2 desirable : 1 undesirable), each prompt with both kinds of answer."""
    out = []
    for i in range(n):
        question, answer = QUESTIONS[(i + offset) % len(QUESTIONS)]
        desirable = i % 3 != 2
        completion = answer if desirable else REFUSALS[i % len(REFUSALS)]
        out.append({"prompt": f"{question} ({i + offset})", "completion": completion, "label": desirable})
    return out
