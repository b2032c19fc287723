"""Pipeline parallelism (plugin.pp_size 2) for every class ``PIPELINE_PARALLEL_FAMILIES`` admits beyond Llama
(test_pipeline_train.py), and pp 4 for Llama and Qwen2, each against the same run at pp_size 1 through
``coati-kto train`` (fp32, SGD lr 1, 2 steps on 2 or 4 gloo processes).

The families' tiny models get 2 decoder layers (one per stage): Mistral's sliding window (8, shorter than the rows)
on every layer, Qwen2's tied embeddings and attention bias, Qwen3's per-head q/k norms, SmolLM3's layer without
RoPE. The weights agree within fp32 summation order (2e-5 of each tensor's update) and step 1's rewards and KL are exactly 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CORPUS
from same_seed_runs import UPDATE_BOUND, assert_step1_rewards_and_kl_zero, update_error
from test_pipeline_train import _config, _train

from coati_kto.testing.built import built

FAMILIES = ("mistral", "qwen2", "qwen3", "smollm3")


def _model(built_root: Path, family: str, layers: int = 2) -> Path:
    from coati_kto.testing.tiny import save_tiny_family

    return built(
        built_root,
        f"tiny_{family}_{layers}",
        lambda out: save_tiny_family(out, family, CORPUS, num_layers=layers),
        {"family": family, "corpus": CORPUS, "num_layers": layers},
    )


@pytest.mark.parametrize(
    "family, pp, kl_scope",
    [*((family, 2, "step") for family in FAMILIES), ("llama", 4, "step"), ("qwen2", 4, "step")]
    + [("llama", 2, "micro_batch")],
    ids=[*FAMILIES, "llama-pp4", "qwen2-pp4", "llama-z0-per-micro-batch"],
)
def test_pp_equals_pp1(family: str, pp: int, kl_scope: str, built_root: Path, tmp_path: Path) -> None:
    """At pp 4 (4 processes, a 4-layer model: one layer a stage, 4 micro-batches a step) the middle stages only
    pass hidden states on and their gradients back. ``kto.kl_scope: micro_batch``: one z0 per micro-batch of the
    schedule run, each its own collective, riding as per-row values."""
    model = _model(built_root, family, pp)
    train, kto = {"max_steps": 2, "accumulation_steps": pp}, {"kl_scope": kl_scope}
    _train(_config(tmp_path, model, 1, "pp1", train=train, kto=kto), 1)
    _train(_config(tmp_path, model, pp, "pp2", train=train, kto=kto), pp)
    error = update_error(tmp_path / "pp2", tmp_path / "pp1", model)
    assert error < UPDATE_BOUND, error
    assert_step1_rewards_and_kl_zero(tmp_path / "pp2")
