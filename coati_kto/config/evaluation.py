"""The ``eval`` section: samples decoded during evaluation (``coati_kto.trainer.samples`` writes them).

When, and on what data, evaluation runs is ``train.eval_*`` and ``data.eval_*``; this section says what it shows
besides the metrics.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from coati_kto.config.section import Section


class EvalSection(Section):
    samples: int = Field(
        0,
        ge=0,
        description="At every evaluation, decode this many eval prompts (a fixed, seeded set) greedily with the "
        "policy (at step 0 also the reference) and write prompt, completion, label and the policy's implied "
        "reward to TensorBoard (text) and W&B (a table); 0: off.",
    )
    sample_max_new_tokens: int = Field(64, ge=1, description="Tokens decoded at most per sample.")
    sample_seed: int = Field(0, ge=0, description="Seed of the choice of the sampled eval prompts.")


def sample_problems(config: Any) -> list[str]:
    """``eval.samples``, ``train.eval_interval`` and ``train.eval_micro_batch_size`` without evaluation data would
    decode, evaluate and batch nothing, in silence (the trainer has no eval loader): one line each."""
    data = config.data
    if data.eval_files or data.eval_fraction:
        return []
    asked = {"eval.samples": config.eval.samples, "train.eval_interval": config.train.eval_interval}
    problems = [
        f"{key} {value} needs evaluation data: set data.eval_files or data.eval_fraction, or {key}=0"
        for key, value in asked.items()
        if value  # 0, the default of both, asks for nothing
    ]
    size = config.train.eval_micro_batch_size  # only the eval loader reads it
    if size is not None:  # None, its default, asks for nothing
        problems.append(
            f"train.eval_micro_batch_size {size} needs evaluation data: set data.eval_files or data.eval_fraction, "
            "or remove train.eval_micro_batch_size"
        )
    return problems
