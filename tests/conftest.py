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
    from coati_kto.testing.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), CORPUS)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def reference_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with perturbed weights: a reference that differs from the policy, so rewards are not 0.

    The output layer gets the larger noise: logits with noise of std s put on average about s**2 / 2 nats less
    on a random token, so the KL log-ratios on random sequences are clearly positive (z0 > 0, unclamped).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        model.lm_head.weight.add_(0.2 * torch.randn(model.lm_head.weight.shape, generator=gen))
    out = tmp_path_factory.mktemp("reference")
    model.save_pretrained(out)
    return out
