"""The shardformer policy the project uses for a model class (``corrected_policy``): its own, from
``coati_kto.families.shardformer``: the one that swaps nothing at tp_size 1, the family's under tensor parallelism.

ColossalAI 0.5.0's policies replace the model's forward with code written for transformers 4.51, which
transformers 5 breaks; the project's policies shard the layers and keep transformers' own forwards.
"""

from __future__ import annotations

from typing import Any

from coati_kto.families.shardformer import policy_for


def corrected_policy(model_class: str | None, tp_size: int = 1) -> Any:
    """A new instance of the project's policy for ``model_class`` (bare or full class name) at ``tp_size``, or
    None (no tensor-parallel policy: config load and ``refuse_unadmitted`` refuse it first)."""
    return policy_for(model_class, tp_size)
