"""ColossalAI plugin from the ``plugin`` config section, with the device-specific settings applied here only."""

from __future__ import annotations

from typing import Any

from coati_kto import compat
from coati_kto.config import PluginSection
from coati_kto.errors import ConfigError


def build_plugin(cfg: PluginSection, max_grad_norm: float, flash_attention: bool = False) -> Any:
    """Create the plugin; call on every rank after ``init_distributed``.

    Gradient clipping lives in the plugin (``max_norm``) so it sees the whole, sharded gradient.
    """
    from colossalai.booster.plugin import (
        GeminiPlugin,
        HybridParallelPlugin,
        LowLevelZeroPlugin,
        TorchDDPPlugin,
    )

    device_kwargs = compat.plugin_overrides()
    if cfg.name == "hybrid_parallel":
        return HybridParallelPlugin(
            tp_size=cfg.tp_size,
            pp_size=1,
            precision=cfg.precision,
            zero_stage=cfg.zero_stage,
            max_norm=max_grad_norm,
            cpu_offload=cfg.cpu_offload,
            enable_flash_attention=flash_attention,
            # Full logits on every tensor-parallel rank: the log-prob gather needs the whole vocabulary row.
            parallel_output=False,
            **device_kwargs,
        )
    if cfg.name == "low_level_zero":
        return LowLevelZeroPlugin(
            stage=cfg.zero_stage,
            precision=cfg.precision,
            max_norm=max_grad_norm,
            cpu_offload=cfg.cpu_offload,
            **device_kwargs,
        )
    if cfg.name == "gemini":
        if not compat.cuda_available():
            raise ConfigError("plugin.name gemini needs CUDA; on CPU use hybrid_parallel or low_level_zero")
        return GeminiPlugin(precision=cfg.precision, max_norm=max_grad_norm, placement_policy="auto")
    if cfg.precision != "fp32":
        raise ConfigError(
            "plugin.name ddp trains in fp32 here: set plugin.precision=fp32 (or use a ZeRO plugin)"
        )
    return TorchDDPPlugin()
