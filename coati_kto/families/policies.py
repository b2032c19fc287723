"""The shardformer policy the project uses for a model class (``corrected_policy``): its own, from
``coati_kto.families.shardformer``, for every family hybrid_parallel admits.

ColossalAI 0.5.0's policies replace the model's forward with code written for transformers 4.51, which
transformers 5 breaks; the project's policies shard the layers and keep transformers' own forwards.
"""

from __future__ import annotations

from typing import Any

from coati_kto.families.shardformer import policy_for


def corrected_policy(model_class: str | None) -> Any:
    """A new instance of the project's policy for ``model_class`` (bare or full class name), or None."""
    return policy_for(model_class)
