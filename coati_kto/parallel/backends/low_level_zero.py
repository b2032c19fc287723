"""``plugin.name: low_level_zero``: ColossalAI's LowLevelZeroPlugin, ZeRO stage 1 or 2 without tensor parallelism."""

from __future__ import annotations

from typing import Any

from torch import nn

from coati_kto.parallel.backends.base import ParallelBackend
from coati_kto.parallel.upstream.cpu import plugin_overrides


class LowLevelZeroBackend(ParallelBackend):
    """ZeRO shards the optimizer states (stage 1) and the gradients (stage 2) over the data-parallel ranks.

    The working parameters stay whole on every rank, so the chunked LM head and decoding run as on one rank.
    The gradient norm is read from ZeRO's gradient store; the plugin clips inside its step. ZeRO is the
    plugin's name, so the configured stage always runs, even on one rank. Its checkpoint IO saves
    ``state_dict()`` as it is; ColossalAI 0.5.0's optimizer save of parameters without state and its adapter
    lookup are fixed in ``coati_kto.parallel.upstream.fixes``.
    """

    name = "low_level_zero"
    plugin_class = "LowLevelZeroPlugin"

    def build_plugin(self) -> Any:
        """LowLevelZeroPlugin with gradient clipping (``max_norm``: it sees the whole, sharded gradient)."""
        from colossalai.booster.plugin import LowLevelZeroPlugin

        plan = self.plan
        return LowLevelZeroPlugin(
            stage=plan.zero_stage,
            precision=plan.precision,
            max_norm=plan.max_grad_norm,
            cpu_offload=plan.cpu_offload,
            **plugin_overrides(),
        )

    def place_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The plugin's LowLevelZeroModel: the dtype cast and input casting, no optimizer needed."""
        from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroModel

        return LowLevelZeroModel(model, precision=self.plan.precision)
