"""Shared fixtures: a tiny tokenizer and Llama built offline (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Please add 2 and 3. The answer is 5. Thank you for asking!",
    "def add(a, b):\n    return a + b\n",
    "I cannot help with that. Sorry, that is not possible.",
    "Call the tool search with query weather in Berlin and report the result.",
] * 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny Llama + ChatML BPE tokenizer (vocab 512, hidden 64, 2 layers)."""
    from coati_kto.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), CORPUS)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
