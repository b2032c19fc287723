"""Shardformer's automatic policy choice routed to the project's policies (``coati_kto.families.shardformer``)."""

from __future__ import annotations

from typing import Any

import torch


def route_policies_to_the_project() -> None:
    """Shardformer's automatic policy choice (a plugin built without ``custom_policy``) picks the project's
    policy (coati_kto.families.shardformer): the family's tensor-parallel one where it has one, else the one that
    swaps nothing, which refuses tensor parallelism in one line. ColossalAI 0.5.0's own policies replace forwards
    with transformers-4.51 code that fails, or computes wrong, under transformers 5.
    """
    from colossalai.shardformer.shard import sharder

    from coati_kto.families.shardformer import policy_for

    def project_policy(model: torch.nn.Module) -> Any:
        return policy_for(type(model).__name__, tp_size=2) or policy_for(type(model).__name__)

    sharder.get_autopolicy = project_policy
