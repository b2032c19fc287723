"""The one policy every family runs through shardformer at tp_size 1: nothing swapped, transformers' modules and
forwards as they are, so ZeRO (the plugin's optimizer) is the only thing the plugin adds, as without shardformer.

A family needs a policy of its own (``coati_kto.families.shardformer.TENSOR_PARALLEL_FAMILIES``) only to split its
layers over tensor-parallel ranks. This policy refuses tensor parallelism and sequence parallelism other than all_to_all in one
line (config load refuses them before, from ``TENSOR_PARALLEL_FAMILIES``; this is the guard for a hub id). Under
pipeline parallelism it keeps the stage's modules and runs the stage forward (``pipeline.PipelineStages``).
"""

from __future__ import annotations

from typing import Any

from colossalai.shardformer.policies.base_policy import ModulePolicyDescription, Policy
from torch import nn

from coati_kto.families.shardformer.pipeline import PipelineStages


class UnshardedPolicy(PipelineStages, Policy):
    """Swaps nothing but, under pipeline parallelism, the forward (the stage's); admits any ``...ForCausalLM`` (or
    vision-language) model at tp_size 1 (config load admits pp_size > 1 for the pipeline families only)."""

    def config_sanity_check(self) -> None:
        config = self.shard_config
        # all_to_all sequence parallelism changes no module: the parallel backend wraps the attention kernel.
        other_sp = config.enable_sequence_parallelism and config.sequence_parallelism_mode != "all_to_all"
        if config.enable_tensor_parallelism or other_sp:
            raise ValueError(
                f"{type(self.model).__name__} has no coati-kto tensor-parallel policy: it runs at plugin.tp_size "
                "1 only (no sequence-parallel mode but all_to_all)"
            )

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return self.with_stage_forward({}, type(self.model))

    def postprocess(self) -> nn.Module:
        return self.model
