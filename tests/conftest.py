"""Shared fixtures: a tiny tokenizer and Llama built offline (no hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Property tests on a loaded 2-core machine: no wall-clock deadlines or "too slow" health checks; on CI
# (CI=true) the examples are derandomized so a green run stays green while the code does not change.
settings.register_profile(
    "coati",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.load_profile("coati")

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
