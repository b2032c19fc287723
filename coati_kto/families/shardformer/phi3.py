"""Phi-3 / Phi-4: the project's shardformer policy (transformers 5's own forwards; see
coati_kto.families.shardformer.base).

Phi-3 fuses q, k and v into one ``qkv_proj`` ([q heads | k heads | v heads] by output rows) and gate and up into
``gate_up_proj`` ([gate | up]). A plain column split would give rank 0 all of q and part of k: the heads would mix.
Each fused projection is split part by part (ColossalAI's ``FusedLinear1D_Col``): rank r holds
[q_r | k_r | v_r] and [gate_r | up_r], its own heads and its own slice of the MLP, so transformers' ``chunk(2)``
and the row-parallel ``down_proj`` line up. Its attention slices q from the fused output at
``config.num_attention_heads * head_dim``: each attention gets a copy of the config holding its rank's head count.
The gathered weights (state_dict, export) are in transformers' order. ``tensor_parallel_shape_refusal`` keeps
whole heads per rank; the MLP width must divide too (checked here).
"""

from __future__ import annotations

import copy
from typing import Any

from transformers.models.phi3.modeling_phi3 import (
    Phi3Attention,
    Phi3DecoderLayer,
    Phi3ForCausalLM,
    Phi3Model,
)

from coati_kto.families.shardformer.base import DecoderPolicy


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def qkv_sizes(config: Any) -> list[int]:
    """The rows of q, k and v in Phi-3's fused ``qkv_proj``."""
    kv = config.num_key_value_heads * _head_dim(config)
    return [config.num_attention_heads * _head_dim(config), kv, kv]


def gate_up_sizes(config: Any) -> list[int]:
    """The rows of gate and up in Phi-3's fused ``gate_up_proj``."""
    return [config.intermediate_size, config.intermediate_size]


class Phi3ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Phi3ForCausalLM
    base_model = Phi3Model
    decoder_layer = Phi3DecoderLayer
    column_parallel = ()
    fused_column = {"self_attn.qkv_proj": qkv_sizes, "mlp.gate_up_proj": gate_up_sizes}

    def module_policy(self) -> dict[Any, Any]:
        tp = self.shard_config.tensor_parallel_size
        if self.shard_config.enable_tensor_parallelism and self.model.config.intermediate_size % tp:
            raise ValueError(
                f"tp_size {tp} must divide intermediate_size {self.model.config.intermediate_size}"
            )
        return super().module_policy()

    def postprocess(self) -> Any:
        config = self.shard_config
        if config.enable_tensor_parallelism and config.tensor_parallel_size > 1:
            tp = config.tensor_parallel_size
            for module in self.model.modules():
                if isinstance(module, Phi3Attention):
                    local = copy.copy(module.config)  # this rank's heads: where q ends in the fused output
                    local.num_attention_heads = module.config.num_attention_heads // tp
                    local.num_key_value_heads = module.config.num_key_value_heads // tp
                    module.config = local
                    module.num_key_value_heads = local.num_key_value_heads
        return super().postprocess()
