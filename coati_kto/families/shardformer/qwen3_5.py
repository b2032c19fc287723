"""Qwen 3.5 (dense, text): the project's shardformer policy (transformers 5's own forwards; see
coati_kto.families.shardformer.base).

Full-attention layers are Qwen3's plus an output gate: ``q_proj`` holds, head after head, the head's query and
its gate ([q_0 g_0 | q_1 g_1 | ...]), so a split by output rows keeps whole heads with their gates; the per-head
q/k norms' gradients are summed over the tensor-parallel group.

Linear-attention layers (Gated DeltaNet) are split by heads, never mixing them: ``in_proj_qkv`` is fused
[q (key heads) | k (key heads) | v (value heads)] and split part by part (rank r holds [q_r | k_r | v_r]); the
depthwise ``conv1d`` over those channels is split the same way (``FusedChannelConv1D``); ``in_proj_z`` (the
gate), ``in_proj_b`` / ``in_proj_a`` (one row per value head) by output rows; ``A_log`` and ``dt_bias`` (one per
value head) by rows; ``out_proj`` by input rows. Each key head serves consecutive value heads
(``repeat_interleave``), so rank r's key heads serve exactly its value heads. The gated norm's weight (head_v_dim,
shared by all heads) is replicated with its gradient summed. The module's own widths (``key_dim``,
``value_dim``...) become the rank's. State dicts and exports gather everything back in transformers' order.
"""

from __future__ import annotations

from typing import Any

import torch
from colossalai.shardformer.layer.parallel_module import ParallelModule
from colossalai.shardformer.layer.qkv_fused_linear import (
    gather_fused_qkv_in_gpt2_style,
    split_fused_qkv_in_gpt2_style,
)
from colossalai.shardformer.policies.base_policy import SubModuleReplacementDescription
from colossalai.tensor.d_tensor.api import (
    customized_distributed_tensor_to_existing_param,
    distribute_tensor_with_customization,
    shard_rowwise,
    sharded_tensor_to_existing_param,
)
from torch import nn
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5GatedDeltaNet,
    Qwen3_5TextModel,
)

from coati_kto.families.shardformer.base import COLUMN_PARALLEL, ROW_PARALLEL, DecoderPolicy


def qkv_sizes(config: Any) -> list[int]:
    """The channels of q, k and v in the Gated DeltaNet's fused ``in_proj_qkv`` (and its ``conv1d``)."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return [key, key, config.linear_num_value_heads * config.linear_value_head_dim]


def _group(process_group: Any) -> Any:
    return process_group[0] if isinstance(process_group, (list, tuple)) else process_group


def _split_part_by_part(param: nn.Parameter, split_sizes: list[int], group: Any) -> None:
    """Make ``param`` this rank's [q_r | k_r | v_r] rows (dim 0), gathered back in transformers' order."""

    def shard_fn(tensor: torch.Tensor) -> torch.Tensor:
        return split_fused_qkv_in_gpt2_style(tensor, split_sizes, group, False)

    def gather_fn(tensor: torch.Tensor) -> torch.Tensor:
        return gather_fused_qkv_in_gpt2_style(tensor, split_sizes, group, False)

    with torch.no_grad():
        sharded = distribute_tensor_with_customization(param.data, shard_fn, gather_fn)
    customized_distributed_tensor_to_existing_param(sharded, param)


class FusedChannelConv1D(ParallelModule):
    """A depthwise causal conv1d whose channels are the fused [q | k | v] of ``in_proj_qkv``, split part by part
    as ``FusedLinear1D_Col`` splits that projection. Transformers' Gated DeltaNet reads ``weight`` ([channels,
    1, kernel]) and ``bias`` directly; ``forward`` is nn.Conv1d's on this rank's channels."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, split_sizes: list[int], group: Any):
        super().__init__()
        self.weight, self.bias = weight, bias
        for param in (weight, bias):
            if param is not None:
                _split_part_by_part(param, split_sizes, group)

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *args: Any, split_sizes: list[int], **kwargs: Any
    ) -> FusedChannelConv1D:
        return FusedChannelConv1D(module.weight, module.bias, split_sizes, _group(process_group))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        kernel = self.weight.shape[-1]
        return torch.nn.functional.conv1d(
            hidden_states, self.weight, self.bias, padding=kernel - 1, groups=self.weight.shape[0]
        )


class GatedDeltaNetHeads(Qwen3_5GatedDeltaNet):
    """Transformers' Gated DeltaNet holding this rank's value heads: ``A_log`` and ``dt_bias`` split by rows
    (gathered on save like ParallelModule's), its widths the rank's. Its forward is transformers'."""

    _save_to_state_dict = ParallelModule._save_to_state_dict
    _load_from_state_dict = ParallelModule._load_from_state_dict

    @staticmethod
    def from_native_module(module: nn.Module, process_group: Any, *args: Any, **kwargs: Any) -> nn.Module:
        group = _group(process_group)
        tp = torch.distributed.get_world_size(group)
        with torch.no_grad():
            for param in (module.A_log, module.dt_bias):
                sharded_tensor_to_existing_param(shard_rowwise(param.data, group), param)
        module.num_v_heads //= tp
        module.num_k_heads //= tp
        module.key_dim //= tp
        module.value_dim //= tp
        module.conv_dim //= tp
        module.__class__ = GatedDeltaNetHeads
        return module


LINEAR_COLUMN = ("linear_attn.in_proj_z", "linear_attn.in_proj_b", "linear_attn.in_proj_a")
FULL_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")


class Qwen35ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Qwen3_5ForCausalLM
    base_model = Qwen3_5TextModel
    decoder_layer = Qwen3_5DecoderLayer
    per_head_replicated = ("self_attn.q_norm", "self_attn.k_norm", "linear_attn.norm")
    column_parallel = COLUMN_PARALLEL + LINEAR_COLUMN
    row_parallel = ROW_PARALLEL + ("linear_attn.out_proj",)
    fused_column = {"linear_attn.in_proj_qkv": qkv_sizes}
    optional = FULL_ATTENTION + LINEAR_COLUMN + ("linear_attn.out_proj", "linear_attn.in_proj_qkv")

    def split_counts(self, model_config: Any) -> dict[str, int]:
        names = (
            "num_attention_heads",
            "num_key_value_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
        return {name: getattr(model_config, name) for name in names + ("intermediate_size",)}

    def module_policy(self) -> dict[Any, Any]:
        policy = super().module_policy()
        if self.shard_config.enable_tensor_parallelism:
            policy[self.decoder_layer].sub_module_replacement += [
                SubModuleReplacementDescription(
                    "linear_attn.conv1d",
                    FusedChannelConv1D,
                    kwargs={"split_sizes": qkv_sizes(self.model.config.get_text_config())},
                    ignore_if_not_exist=True,
                ),
                SubModuleReplacementDescription("linear_attn", GatedDeltaNetHeads, ignore_if_not_exist=True),
            ]
        return policy


class Qwen35ForConditionalGenerationPolicy(Qwen35ForCausalLMPolicy):
    """The hub checkpoints' class: its language model split as above, lm_head at the top; the vision tower
    replicated (frozen: the text passes never reach it)."""

    causal_lm = Qwen3_5ForConditionalGeneration
