"""The parallel plan: the one place that knows the ColossalAI plugin and what follows from it.

``ParallelPlan.from_config(config)`` is built from the ``plugin`` and ``train`` sections (whose combinations, and
the model family under ``hybrid_parallel`` via ``check_model_family``, are checked at config load), and answers the
questions the rest of the code would otherwise ask the plugin object:

- ``build_plugin()``: the ColossalAI plugin, with the device-specific settings (coati_kto.parallel.upstream.cpu);
- ``zero_stage``: the stage that runs, which is 0 for hybrid_parallel on one data-parallel rank
  (``running_zero_stage``: nothing to shard there, and the updates are the same bit for bit);
- ``boost(...)``: the policy, optimizer and schedule boosted, what transformers keeps in fp32 kept in fp32, torch
  DDP told to look for unused parameters where the policy has some (``torch_ddp``, ``coati_kto.parallel.unused``);
- ``build_reference(plugin, model)``: the frozen reference through the same plugin path as the policy (same
  shardformer sharding, same dtype cast, same fp32 tensors), so that at step 0 both give identical log-probs;
- ``no_sync_accumulation``: whether accumulation micro-batches may skip the gradient reduction;
- ``kl_group(layout)``: the group the reference point z0 reduces over;
- ``gradient_norm(optimizer, layout)``: where the step's gradient norm comes from and who clips.

What stays fp32 (coati_kto.parallel.fp32_kept): the plugins cast the policy with ``module.to(bf16)``, which also
casts what ``from_pretrained(dtype=bf16)`` keeps in fp32 (rotary ``inv_freq``; the MoE routers' ``gate.weight`` and
``e_score_correction_bias`` in ``_keep_in_fp32_modules_strict``). The policy and the reference must compute them
the same way, and as the exported model reloaded in bf16 does: those buffers, and those parameters that are
frozen, get their fp32 values back after the cast (trainable ones stay in the working dtype: ZeRO's optimizer
holds one dtype). Buffers transformers builds in the load dtype (Falcon-H1's ``mup_vector``) stay cast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from coati_kto.config.schema import PluginName, Precision
from coati_kto.errors import ConfigError
from coati_kto.families import model_class_name, refuse_unadmitted
from coati_kto.families.policies import corrected_policy
from coati_kto.parallel import optimizer_path
from coati_kto.parallel.distributed import reduce_sums
from coati_kto.parallel.fp32_kept import fp32_kept, restore
from coati_kto.parallel.grad_norm import GradNorm
from coati_kto.parallel.ordered_grads import data_dependent_graph, install_ordered_reduction
from coati_kto.parallel.unused import unreached_parameters
from coati_kto.parallel.upstream.cpu import plugin_overrides

if TYPE_CHECKING:
    from coati_kto.config.schema import Config, PluginSection
    from coati_kto.parallel.distributed import ParallelLayout


def running_zero_stage(section: PluginSection, dp_size: int | None) -> int:
    """The ZeRO stage the run uses: ``plugin.zero_stage``, except hybrid_parallel on one data-parallel rank.

    There ZeRO has nothing to shard, yet its buckets, flat fp32 copies and per-backward reductions all run (and on
    CUDA a device synchronize after every backward), and ColossalAI warns about it. Stage 0 runs the AMP
    optimizer instead: the same fp32 masters and the same updates, bit for bit (clipped Adam steps, and KTO
    steps with accumulation: every logged number and weight; tests/distributed/test_checkpoint.py).
    ``cpu_offload`` needs ZeRO, so it keeps the stage. low_level_zero is ZeRO by name and keeps it too.
    """
    if (
        dp_size == 1
        and section.name == "hybrid_parallel"
        and section.zero_stage > 0
        and not section.cpu_offload
    ):
        return 0
    return section.zero_stage


def check_tp_divides_world(tp_size: int, world: int) -> None:
    """ConfigError (one line; every rank raises it, rank 0 prints it) when ``world`` processes cannot form
    tensor-parallel groups of ``tp_size``: ColossalAI's plugin asserts it later, a traceback on every rank."""
    if world % tp_size:
        raise ConfigError(
            f"plugin.tp_size {tp_size} must divide the number of processes, {world}: launch a multiple of "
            f"{tp_size} (e.g. --nproc-per-node {tp_size}), or set plugin.tp_size=1"
        )


@dataclass(frozen=True)
class ParallelPlan:
    """How the run is parallelised; built on every rank from the same config, so identical everywhere."""

    plugin: PluginName
    precision: Precision
    zero_stage: int
    tp_size: int = 1
    cpu_offload: bool = False
    max_grad_norm: float = 0.0
    flash_attention: bool = False
    # Full class name of the policy model (model_class_name), when config.json tells it: picks the family's
    # tensor-parallel policy (``families.policies.corrected_policy``; at tp_size 1 one policy swaps nothing).
    model_class: str | None = None
    # The data-parallel size the run has, when known (``from_config(config, dp_size)``); None: not known.
    dp_size: int | None = None

    # ---- construction / validation ----------------------------------------------------------------------
    @classmethod
    def from_section(
        cls,
        section: PluginSection,
        max_grad_norm: float = 0.0,
        flash_attention: bool = False,
        model_class: str | None = None,
        dp_size: int | None = None,
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
        )

    @classmethod
    def from_plugin(cls, plugin: Any) -> ParallelPlan:
        """Recover the plan from a plugin object (callers that built the plugin themselves, e.g. old tests)."""
        kind = type(plugin).__name__
        name = {
            "HybridParallelPlugin": "hybrid_parallel",
            "LowLevelZeroPlugin": "low_level_zero",
            "GeminiPlugin": "gemini",
        }.get(kind, "ddp")
        stage = getattr(plugin, "zero_stage", getattr(plugin, "stage", 0))
        return cls(
            plugin=name,
            precision=getattr(plugin, "precision", "fp32"),
            zero_stage=int(stage),
            tp_size=int(getattr(plugin, "tp_size", 1) or 1),
            max_grad_norm=float(getattr(plugin, "max_norm", 0.0) or 0.0),
        )

    # ---- answers ------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The working (forward) dtype of the policy and the reference."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)

    @property
    def forward_collectives(self) -> bool:
        """Whether the policy's gradient forward enters a collective of the data-parallel group: torch DDP's does
        (its bucket rebuild at the second gradient forward, its buffer broadcast): ddp, and hybrid_parallel at
        ZeRO-0, at more than one data-parallel rank (``torch_ddp``). There no rank may order that forward and the
        z0 all-reduce otherwise than the others, so the KL pass neither folds into the gradient pass nor
        continues from its cache: both are each rank's own decision from its batch (a fold from its lengths, a
        continuation from its prompt truncation), and either runs the forward before z0. A tensor-parallel
        forward's collectives stay inside its tp group, whose ranks see the same batch and so decide alike."""
        return self.torch_ddp

    @property
    def torch_ddp(self) -> bool:
        """Whether the policy gets wrapped in torch DDP: ddp, or hybrid_parallel at ZeRO-0, unless the run has
        one data-parallel rank (then neither plugin wraps it: ``optimizer_path.single_rank_ddp_plugin``,
        ``upstream.fixes._fix_ddp_on_one_data_parallel_rank``). ``boost`` then tells DDP whether to look for parameters a
        backward does not reach (``coati_kto.parallel.unused``)."""
        if self.dp_size == 1:
            return False
        return self.plugin == "ddp" or (self.plugin == "hybrid_parallel" and self.zero_stage == 0)

    @property
    def no_sync_accumulation(self) -> bool:
        """Whether micro-batches before a step's last may skip the gradient reduction (``booster.no_sync``).

        DDP, hybrid ZeRO-0/1 and low-level ZeRO-1 support it. ZeRO-2 (hybrid or low-level) asserts against it:
        there every backward reduce-scatters and gradients accumulate in the ZeRO buffers.
        """
        return self.zero_stage != 2 and self.plugin != "gemini"

    def gradient_norm(
        self, optimizer: Any, layout: ParallelLayout, max_norm: float | None = None
    ) -> GradNorm:
        """Where the step's global gradient norm comes from, and who clips (the clipping / non-finite vote hook).

        The norm is always taken before the optimizer steps (coati_kto.parallel.grad_norm): from ``p.grad``
        (ddp, hybrid zero 0: the whole averaged gradient on every data-parallel rank) or from ZeRO's gradient
        store (each rank's partition). ddp has no clipping, so GradNorm clips it; ZeRO and the hybrid plugin
        clip inside their own step with ``max_grad_norm`` (``build_plugin``), handed the norm already taken.
        """

        return GradNorm(optimizer, self.max_grad_norm if max_norm is None else max_norm, layout)

    def kl_group(self, layout: ParallelLayout) -> Any:
        """The process group z0 reduces over: the data-parallel ranks (tensor-parallel peers hold the same
        batch). None means "no reduction" (one data-parallel rank), unlike the layout's None (= world)."""
        import torch.distributed as dist

        if layout.dp_size <= 1 or not dist.is_initialized():
            return None
        return layout.dp_group if layout.dp_group is not None else dist.group.WORLD

    # ---- building -----------------------------------------------------------------------------------------
    def build_plugin(self) -> Any:
        """The ColossalAI plugin; every rank calls, after ``init_distributed``.

        Gradient clipping lives in the ZeRO / hybrid plugins (``max_norm``) so it sees the whole, sharded
        gradient; TorchDDPPlugin has none, ``gradient_norm`` clips there.
        """
        from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin

        device_kwargs = plugin_overrides()
        if self.plugin == "hybrid_parallel":
            return HybridParallelPlugin(
                tp_size=self.tp_size,
                pp_size=1,
                precision=self.precision,
                zero_stage=self.zero_stage,
                max_norm=self.max_grad_norm,
                cpu_offload=self.cpu_offload,
                # Flash attention comes from transformers (model.attn_implementation), whose forwards the
                # project's policies keep; ColossalAI's flash forwards are written for transformers 4.51.
                enable_flash_attention=False,
                # Full logits on every tensor-parallel rank: the log-prob gather needs the whole vocabulary row.
                parallel_output=False,
                custom_policy=corrected_policy(self.model_class, self.tp_size),
                **device_kwargs,
            )
        if self.plugin == "low_level_zero":
            return LowLevelZeroPlugin(
                stage=self.zero_stage,
                precision=self.precision,
                max_norm=self.max_grad_norm,
                cpu_offload=self.cpu_offload,
                **device_kwargs,
            )
        if self.plugin == "ddp":
            # No buffer broadcast: DDP runs it inside the forward after a gradient forward, a collective, while
            # ranks run data-dependent numbers of no-grad forwards (a micro-batch whose KL pass folds into the
            # gradient pass skips one): the ranks then entered different collectives (gloo aborted on a
            # resumed cached-reference run). The buffers (rotary frequencies, scales) are equal on every rank.
            if self.dp_size == 1:  # nothing to reduce: no DDP buckets (coati_kto.parallel.optimizer_path)
                return optimizer_path.single_rank_ddp_plugin(broadcast_buffers=False)
            return TorchDDPPlugin(broadcast_buffers=False)
        raise ConfigError(f"plugin.name {self.plugin} cannot be built (the config check refuses it)")

    def boost(
        self, booster: Any, policy: nn.Module, optimizer: Any, lr_scheduler: Any
    ) -> tuple[Any, Any, Any]:
        """``booster.boost`` the policy (loaded in fp32), then give what runs in fp32 (``fp32_kept``) its values back."""
        kept = fp32_kept(policy, self.dtype)
        if self.plugin == "hybrid_parallel":  # the class config.json could not tell (a hub id) is known now
            # The transformers class, under a LoRA PeftModel too (not yet wrapped by the plugin here).
            inner = type(policy.get_base_model() if hasattr(policy, "get_base_model") else policy)
            model_class = f"{inner.__module__}.{inner.__qualname__}"
            refuse_unadmitted(model_class, self.tp_size, "model.path: ")
            booster.plugin.custom_policy = corrected_policy(model_class, self.tp_size)
        if self.torch_ddp:  # before DDP is built around the policy: it reads the setting once
            ddp_kwargs = getattr(booster.plugin, "ddp_kwargs", None) or booster.plugin.ddp_config
            # Any rank's answer holds on all (one all-reduce, every rank is here): DDP's used-flags are all-reduced
            # only where it looks for unused parameters, so ranks built apart would hang at the first backward.
            unused = float(unreached_parameters(policy) != [])
            ddp_kwargs["find_unused_parameters"] = reduce_sums({"unused": unused}, None)["unused"] > 0
        policy, optimizer, _, _, lr_scheduler = booster.boost(policy, optimizer, lr_scheduler=lr_scheduler)
        restore(kept)
        # The project's gradient path after the backward (coati_kto.parallel.optimizer_path): no second norm, no
        # multiply by 1, and at one ZeRO rank no bucket flatten / divide / all-gather.
        optimizer_path.install_clipping(optimizer)
        optimizer_path.install_single_rank_zero(optimizer)
        optimizer_path.install_mixed_precision_step(optimizer)
        optimizer_path.install_fused_zero(optimizer)  # train.fused_optimizer (MixedAdamW) under ZeRO
        if data_dependent_graph(policy):  # identity experts: ranks may reach different parameters
            install_ordered_reduction(optimizer)
        return policy, optimizer, lr_scheduler

    def build_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The frozen reference, built the way ``boost`` builds the policy but without an optimizer.

        ``model`` is loaded in fp32 like the policy. hybrid_parallel: the plugin's own HybridParallelModule
        (shardformer with the plugin's shard config: under tp_size N each rank holds 1/N of the sharded
        weights; the same dtype cast), without DDP, which refuses a module with no trainable parameter.
        low_level_zero: its LowLevelZeroModel (the dtype cast and input casting, no optimizer needed). ddp:
        the module on the device (fp32). Every rank calls (shardformer's sharding is per rank).
        """
        from colossalai.accelerator import get_accelerator

        kept = fp32_kept(model, self.dtype)
        if self.plugin == "hybrid_parallel":
            from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelModule

            reference_class = f"{type(model).__module__}.{type(model).__qualname__}"
            refuse_unadmitted(reference_class, self.tp_size, "model.reference_path: ")
            wrapped: nn.Module = HybridParallelModule(
                model,
                precision=plugin.precision,
                shard_config=plugin.shard_config,
                dp_group=plugin.mixed_dp_group,
                tp_group=plugin.tp_group,
                sp_group=plugin.sp_group,
                use_ddp=False,
                ddp_config={},
                # By the reference's own class: model.reference_path may hold another family than the policy.
                custom_policy=corrected_policy(reference_class, self.tp_size),
            )
        elif self.plugin == "low_level_zero":
            from colossalai.booster.plugin.low_level_zero_plugin import LowLevelZeroModel

            wrapped = LowLevelZeroModel(model, precision=self.precision)
        else:
            wrapped = model.to(get_accelerator().get_current_device(), self.dtype)
        restore(kept)
        return wrapped.eval().requires_grad_(False)
