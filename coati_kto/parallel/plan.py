"""The parallel plan: the run's parallel settings, and the backend that knows its ColossalAI plugin.

``ParallelPlan.from_config(config)`` is built from the ``plugin`` and ``train`` sections (whose combinations, and
the model family at the tensor-parallel size via ``check_model_family``, are checked at config load). It holds
what every rank agrees on (the plugin's name, precision, the ZeRO stage that runs, the tensor-parallel and
data-parallel sizes) and answers what does not depend on the plugin:

- ``dtype``: the working dtype of the policy and the reference;
- ``kl_group(layout)``: the group the reference point z0 reduces over;
- ``backend``: the ``ParallelBackend`` of its plugin (coati_kto.parallel.backends), which answers the rest:
  building and boosting, the reference's placement, the gradient-norm source, no_sync, the chunked head.

What stays fp32 (coati_kto.parallel.fp32_kept): the plugins cast the policy with ``module.to(bf16)``, which also
casts what ``from_pretrained(dtype=bf16)`` keeps in fp32 (rotary ``inv_freq``; the MoE routers' ``gate.weight`` and
``e_score_correction_bias`` in ``_keep_in_fp32_modules_strict``). The policy and the reference must compute them
the same way, and as the exported model reloaded in bf16 does: those buffers, and those parameters that are
frozen, get their fp32 values back after the cast (trainable ones stay in the working dtype: ZeRO's optimizer
holds one dtype). Buffers transformers builds in the load dtype (Falcon-H1's ``mup_vector``) stay cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from coati_kto.config.schema import PluginName, Precision
from coati_kto.errors import ConfigError
from coati_kto.families import model_class_name
from coati_kto.parallel.backends import ParallelBackend, backend_class, backend_of

if TYPE_CHECKING:
    from coati_kto.config.schema import Config, PluginSection
    from coati_kto.parallel.distributed import ParallelLayout


def running_zero_stage(section: PluginSection, dp_size: int | None) -> int:
    """The ZeRO stage the run uses at ``dp_size`` data-parallel ranks: its backend's answer
    (``ParallelBackend.running_zero_stage``; None: as written)."""
    return backend_class(section.name).running_zero_stage(section, dp_size)


def check_tp_divides_world(tp_size: int, world: int, sp_size: int = 1) -> None:
    """ConfigError (one line; every rank raises it, rank 0 prints it) when ``world`` processes cannot form
    tensor-parallel groups of ``tp_size`` times sequence-parallel groups of ``sp_size``: ColossalAI's plugin
    asserts it later, a traceback on every rank."""
    if world % (tp_size * sp_size) == 0:
        return
    if sp_size == 1:
        raise ConfigError(
            f"plugin.tp_size {tp_size} must divide the number of processes, {world}: launch a multiple of "
            f"{tp_size} (e.g. --nproc-per-node {tp_size}), or set plugin.tp_size=1"
        )
    raise ConfigError(
        f"plugin.tp_size {tp_size} x plugin.sp_size {sp_size} = {tp_size * sp_size} must divide the number of "
        f"processes, {world}: launch a multiple of {tp_size * sp_size}"
    )


@dataclass(frozen=True)
class ParallelPlan:
    """How the run is parallelised; built on every rank from the same config, so identical everywhere."""

    plugin: PluginName
    precision: Precision
    zero_stage: int
    tp_size: int = 1
    # Sequence parallelism (all_to_all: each sp rank runs 1/sp_size of every row's columns); 1: off.
    sp_size: int = 1
    # Pipeline parallelism: pp_size stages, ColossalAI's schedule (``pp_style``, ``num_model_chunks`` per rank when
    # interleaved), ``microbatches`` per step (the step's accumulation micro-batches); 1: off.
    pp_size: int = 1
    pp_style: str = "1f1b"
    num_model_chunks: int = 1
    microbatches: int = 1
    cpu_offload: bool = False
    max_grad_norm: float = 0.0
    flash_attention: bool = False
    # Full class name of the policy model (model_class_name), when config.json tells it: picks the family's
    # tensor-parallel policy (``families.policies.corrected_policy``; at tp_size 1 one policy swaps nothing).
    model_class: str | None = None
    # The ranks each gradient is averaged over, when known (``from_config(config, dp_size)``): world / (tp_size x
    # pp_size), which under all_to_all sequence parallelism is dp x sp (the plugin's gradient group); None: not known.
    dp_size: int | None = None

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_section(
        cls,
        section: PluginSection,
        max_grad_norm: float = 0.0,
        flash_attention: bool = False,
        model_class: str | None = None,
        dp_size: int | None = None,
        microbatches: int = 1,
    ) -> ParallelPlan:
        """From a validated ``plugin`` section (its combinations are checked there, at config load).

        ``dp_size``: the data-parallel size the run will have (known after ``init_distributed``); None keeps
        the section's ZeRO stage as written (callers that only ask for the dtype).
        """
        return cls(
            plugin=section.name,
            precision=section.precision,
            zero_stage=running_zero_stage(section, dp_size),
            tp_size=section.tp_size,
            sp_size=section.sp_size,
            pp_size=getattr(section, "pp_size", 1),
            pp_style=getattr(section, "pp_style", "1f1b"),
            num_model_chunks=getattr(section, "num_model_chunks", 1),
            microbatches=microbatches,
            cpu_offload=section.cpu_offload,
            max_grad_norm=max_grad_norm,
            flash_attention=flash_attention,
            model_class=model_class,
            dp_size=dp_size,
        )

    @classmethod
    def from_config(cls, config: Config, dp_size: int | None = None) -> ParallelPlan:
        """The plan of a validated ``config`` (Config checks the family against the plugin at load); see
        ``from_section`` for ``dp_size``."""
        return cls.from_section(
            config.plugin,
            config.train.max_grad_norm,
            config.model.attn_implementation == "flash_attention_2",
            model_class_name(config.model.path),
            dp_size,
            config.train.accumulation_steps,
        )

    @classmethod
    def from_plugin(cls, plugin: Any) -> ParallelPlan:
        """Recover the plan from a plugin object (callers that built the plugin themselves, e.g. old tests)."""
        stage = getattr(plugin, "zero_stage", getattr(plugin, "stage", 0))
        return cls(
            plugin=backend_of(plugin).name,
            precision=getattr(plugin, "precision", "fp32"),
            zero_stage=int(stage),
            tp_size=int(getattr(plugin, "tp_size", 1) or 1),
            sp_size=int(getattr(plugin, "sp_size", 1) or 1)
            if getattr(plugin, "enable_sequence_parallelism", False)
            else 1,
            max_grad_norm=float(getattr(plugin, "max_norm", 0.0) or 0.0),
        )

    # ---- answers ------------------------------------------------------------------------------------------
    @cached_property
    def backend(self) -> ParallelBackend:
        """The backend of this plan's plugin: every question that depends on the plugin is asked of it."""
        return backend_class(self.plugin)(self)

    @property
    def dtype(self) -> torch.dtype:
        """The working (forward) dtype of the policy and the reference."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)

    def kl_group(self, layout: ParallelLayout) -> Any:
        """The process group z0 reduces over: the data-parallel ranks (tensor-parallel peers hold the same
        batch). None means "no reduction" (one data-parallel rank), unlike the layout's None (= world)."""
        import torch.distributed as dist

        if layout.dp_size <= 1 or not dist.is_initialized():
            return None
        return layout.dp_group if layout.dp_group is not None else dist.group.WORLD
