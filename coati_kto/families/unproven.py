"""Model types that build and train but fail the family sweep's checks (docs/family_sweep.md): refused at config
load on every plugin, each with what the sweep found, so no run trains a model whose export or first step is
known to be wrong. A type leaves this table when the sweep (tests/distributed/family_sweep.py) passes it.
"""

from __future__ import annotations

from typing import Any

_STEP1_NOT_ZERO = (
    "its first step's rewards are not 0 with the policy equal to the reference ({} apart in the sweep: its "
    "gradient and no-gradient forwards differ), so the KTO reference point is off"
)
# model_type -> what fails (transformers 5.24, both plugins, ZeRO-2 bf16 and fp32 alike).
UNPROVEN_TYPES: dict[str, str] = {
    "youtu": (
        "transformers zeroes the pad_token_id row of the embeddings (tied to the LM head) on every load "
        "(YoutuPreTrainedModel._init_weights writes through .data), so an exported model does not reload as "
        "trained (0.03 apart in the sweep)"
    ),
    "doge": _STEP1_NOT_ZERO.format("1e-4"),
    "inkling_text": _STEP1_NOT_ZERO.format("4e-6"),
}


def unproven_refusal(raw: dict[str, Any]) -> str | None:
    """Why the model of config.json ``raw`` is refused as failing the family sweep (None when it is not)."""
    model_type = raw.get("model_type")
    if model_type not in UNPROVEN_TYPES:
        return None
    return f"model_type {model_type} is not supported: {UNPROVEN_TYPES[model_type]} (docs/family_sweep.md)"
