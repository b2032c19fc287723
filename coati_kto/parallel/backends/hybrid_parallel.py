"""``plugin.name: hybrid_parallel``: ColossalAI's HybridParallelPlugin, tensor parallelism with ZeRO 0 to 2.

The one backend with a tensor-parallel axis: shardformer swaps each layer for its split version through the
project's policy of the model's family (``coati_kto.families.shardformer``; at ``tp_size`` 1 one policy that
swaps nothing admits every family).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from coati_kto.errors import ConfigError
from coati_kto.families.policies import corrected_policy
from coati_kto.families.splits import (
    layers_of,
    pipeline_layers_refusal,
    refuse_unadmitted,
    sequence_heads_refusal,
    tensor_parallel_shape_refusal,
)
from coati_kto.parallel.backends.base import ParallelBackend
from coati_kto.parallel.sequence import SEQUENCE_GROUP, install_attention
from coati_kto.parallel.upstream.cpu import cuda_available, plugin_overrides

if TYPE_CHECKING:
    from coati_kto.config.schema import PluginSection


def class_name(module: nn.Module) -> str:
    """The full class name of ``module``'s transformers class, under a LoRA PeftModel too."""
    inner = type(module.get_base_model() if hasattr(module, "get_base_model") else module)
    return f"{inner.__module__}.{inner.__qualname__}"


class HybridParallelBackend(ParallelBackend):
    """Tensor-parallel groups of ``tp_size`` ranks inside each data-parallel replica, ZeRO over the replicas.

    - The LM head's vocabulary split: above tp_size 1 the head holds a slice of the vocabulary per rank; the
      plugin is built with ``parallel_output=False``, so every rank gets the whole row of logits (the log-prob
      gather needs it) and the chunked head, which would read a slice, is not used (``LMHead.find``).
    - The reference: the plugin's own HybridParallelModule (the same sharding, the same dtype cast), without
      DDP, which refuses a module with no trainable parameter.
    - The gradient norm: ``p.grad`` at ZeRO 0, ZeRO's store above; the plugin clips inside its step.
    - The checkpoint IO gathers the tensor-parallel shards and unpads padded vocabularies (ColossalAI 0.5.0's
      save of a padded vocabulary and its tensor-parallel partition check are fixed in ``upstream.fixes``).
    - It refuses a model class its tensor-parallel policies do not prove at ``tp_size`` (config load checks
      config.json; ``prepare_policy`` and ``place_reference`` check the class a hub id builds).
    - Sequence parallelism (``sp_size`` > 1, all_to_all): the plugin builds the sp groups and averages gradients
      over dp x sp; none of its sequence-parallel forwards run (they are written for transformers 4.51). The
      policy and the reference get the ``coati_sp|`` attention wrapper instead (``coati_kto.parallel.sequence``),
      whose group ``build_plugin`` sets, and the passes feed each rank its slice of the rows.
    """

    name = "hybrid_parallel"
    plugin_class = "HybridParallelPlugin"

    @classmethod
    def running_zero_stage(cls, section: PluginSection, dp_size: int | None) -> int:
        """``plugin.zero_stage``, except 0 on one data-parallel rank.

        There ZeRO has nothing to shard, yet its buckets, flat fp32 copies and per-backward reductions all run
        (and on CUDA a device synchronize after every backward), and ColossalAI warns about it. Stage 0 runs
        the AMP optimizer instead: the same fp32 masters and the same updates, bit for bit (clipped Adam steps,
        and KTO steps with accumulation: every logged number and weight; tests/distributed/test_checkpoint.py).
        ``cpu_offload`` needs ZeRO, so it keeps the stage.
        """
        if dp_size == 1 and section.zero_stage > 0 and not section.cpu_offload:
            return 0
        return section.zero_stage

    @property
    def torch_ddp(self) -> bool:
        """Torch DDP wraps the policy at ZeRO 0 on more than one data-parallel rank (one data-parallel rank never
        gets DDP: ``upstream.fixes._fix_ddp_on_one_data_parallel_rank``; the pipeline schedule never does: it
        reduces the gradients itself after its run)."""
        return self.plan.dp_size != 1 and self.plan.zero_stage == 0 and self.plan.pp_size == 1

    def build_plugin(self) -> Any:
        """HybridParallelPlugin with the project's policy for the model class config.json names (checked again at
        ``prepare_policy`` with the class itself) and gradient clipping (``max_norm``) inside its step."""
        from colossalai.booster.plugin import HybridParallelPlugin

        plan = self.plan
        sequence = plan.sp_size > 1
        plugin = HybridParallelPlugin(
            tp_size=plan.tp_size,
            pp_size=plan.pp_size,
            **self._pipeline_settings(),
            sp_size=plan.sp_size,
            enable_sequence_parallelism=sequence,
            # all_to_all: its own sp axis (config load refuses the other modes).
            sequence_parallelism_mode="all_to_all" if sequence else None,
            precision=plan.precision,
            zero_stage=plan.zero_stage,
            max_norm=plan.max_grad_norm,
            cpu_offload=plan.cpu_offload,
            # Flash attention comes from transformers (model.attn_implementation), whose forwards the
            # project's policies keep; ColossalAI's flash forwards are written for transformers 4.51.
            enable_flash_attention=False,
            # Full logits on every tensor-parallel rank: the log-prob gather needs the whole vocabulary row.
            parallel_output=False,
            custom_policy=corrected_policy(plan.model_class, plan.tp_size),
            **plugin_overrides(),
        )
        # The attention wrapper's group (one per process); None clears one a previous run in this process set.
        SEQUENCE_GROUP.set(plugin.sp_group if sequence else None)
        return plugin

    def _pipeline_settings(self) -> dict[str, Any]:
        """The plugin's schedule under pipeline parallelism (nothing at pp_size 1).

        - ``num_microbatches``: the step's accumulation micro-batches, one schedule run per step.
        - No metadata cache: it keeps the first run's activation shapes, and every step (and pass) pads to its
          own length; a longer activation then aborts the receiving rank (measured on gloo).
        - ``overlap_p2p`` only on CUDA: the interleaved schedule's in-flight requests hung on gloo (6 of 11 runs).
        """
        plan = self.plan
        if plan.pp_size == 1:
            return {}
        return {
            "pp_style": plan.pp_style,
            "num_model_chunks": plan.num_model_chunks,
            "num_microbatches": plan.microbatches,
            "enable_metadata_cache": False,
            "overlap_p2p": cuda_available(),
        }

    def prepare_policy(self, booster: Any, policy: nn.Module) -> None:
        """The class config.json could not tell (a hub id) is known now: refused unless admitted at tp_size,
        else its policy replaces the one ``build_plugin`` chose (the plugin has not wrapped the model yet)."""
        model_class = class_name(policy)
        refuse_unadmitted(
            model_class, self.plan.tp_size, "model.path: ", self.plan.sp_size, self.plan.pp_size
        )
        self._refuse_shape(policy, "model.path")
        self._sequence_attention(policy, "model.path")
        booster.plugin.custom_policy = corrected_policy(model_class, self.plan.tp_size)

    def ddp_settings(self, plugin: Any) -> dict[str, Any]:
        return plugin.ddp_config

    def place_reference(self, plugin: Any, model: nn.Module) -> nn.Module:
        """The plugin's HybridParallelModule (shardformer with the plugin's shard config: under tp_size N each rank
        holds 1/N of the sharded weights), by the reference's own class: model.reference_path may hold another
        family than the policy. Every rank calls (shardformer's sharding is per rank)."""
        from colossalai.booster.plugin.hybrid_parallel_plugin import HybridParallelModule

        reference_class = f"{type(model).__module__}.{type(model).__qualname__}"
        refuse_unadmitted(
            reference_class, self.plan.tp_size, "model.reference_path: ", self.plan.sp_size, self.plan.pp_size
        )
        self._refuse_shape(model, "model.reference_path")
        self._sequence_attention(model, "model.reference_path")
        return HybridParallelModule(
            model,
            precision=plugin.precision,
            shard_config=plugin.shard_config,
            dp_group=plugin.mixed_dp_group,
            tp_group=plugin.tp_group,
            sp_group=plugin.sp_group,
            use_ddp=False,
            ddp_config={},
            custom_policy=corrected_policy(reference_class, self.plan.tp_size),
        )

    def _refuse_shape(self, model: nn.Module, key: str) -> None:
        """Config load's line (a ConfigError) for what config load checks from config.json, where it could not
        read one (a Hub id not in the hub cache): heads tp_size cannot split, and fewer decoder layers than
        pipeline chunks. Shardformer and ColossalAI's stage manager would fail on them with a traceback."""
        bare = model.get_base_model() if hasattr(model, "get_base_model") else model
        raw = bare.config.to_dict()
        why = tensor_parallel_shape_refusal(raw, self.plan.tp_size)
        if self.plan.pp_size > 1:
            layers = layers_of(raw)
            why = why or pipeline_layers_refusal(layers, self.plan.pp_size, self.plan.num_model_chunks)
        if why is not None:
            raise ConfigError(f"{key} {bare.config.name_or_path or type(bare).__name__}: {why}")

    def _sequence_attention(self, model: nn.Module, key: str) -> None:
        """Under sequence parallelism: ``model``'s attention (the bare transformers model's, under a LoRA PeftModel
        too) wrapped by ``coati_kto.parallel.sequence.install_attention``. Heads tp x sp cannot split are refused
        first, in config load's line: config load reads a Hub id's config.json only from the hub cache, and the
        first forward would raise on every rank."""
        if self.plan.sp_size == 1:
            return
        bare = model.get_base_model() if hasattr(model, "get_base_model") else model
        why = sequence_heads_refusal(bare.config.to_dict(), self.plan.tp_size, self.plan.sp_size)
        if why is not None:
            raise ConfigError(f"{key} {bare.config.name_or_path or type(bare).__name__}: {why}")
        install_attention(bare)
