"""The one policy every family runs through shardformer at tp_size 1: nothing swapped, transformers' modules and
forwards as they are, so ZeRO (the plugin's optimizer) is the only thing the plugin adds, as without shardformer.

A family needs a policy of its own (``coati_kto.families.shardformer.TENSOR_PARALLEL_FAMILIES``) only to split its
layers over tensor-parallel ranks. This policy refuses tensor, pipeline and sequence parallelism other than all_to_all in one
line (config load refuses them before, from ``TENSOR_PARALLEL_FAMILIES``; this is the guard for a hub id).
"""

from __future__ import annotations

from typing import Any

from colossalai.shardformer.policies.base_policy import ModulePolicyDescription, Policy
from torch import nn


class UnshardedPolicy(Policy):
    """Swaps nothing; admits any ``...ForCausalLM`` (or vision-language) model at tp_size 1."""

    def config_sanity_check(self) -> None:
        config = self.shard_config
        # all_to_all sequence parallelism changes no module: the parallel backend wraps the attention kernel.
        other_sp = config.enable_sequence_parallelism and config.sequence_parallelism_mode != "all_to_all"
        if config.enable_tensor_parallelism or config.pipeline_stage_manager is not None or other_sp:
            raise ValueError(
                f"{type(self.model).__name__} has no coati-kto tensor-parallel policy: it runs at plugin.tp_size "
                "1 only (no pipeline parallelism, no sequence-parallel mode but all_to_all)"
            )

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return {}

    def postprocess(self) -> nn.Module:
        return self.model

    def get_held_layers(self) -> list[nn.Module]:
        return [self.model]
