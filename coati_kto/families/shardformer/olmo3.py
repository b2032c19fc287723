"""OLMo 3: the project's shardformer policy (transformers 5's own forwards; see
coati_kto.families.shardformer.base).

OLMo normalises the whole query projection (all heads together: ``q_norm`` has num_heads x head_dim weights, and
``k_norm`` likewise) before splitting it into heads. Under tensor parallelism a rank holds its own heads' slice of
q, so the norm's mean of squares must cover every rank's slice: ``RMSNormAcrossRanks`` holds the matching slice of
the weight (split with q_proj's rows) and all-reduces the sum of squares over the tensor-parallel group before
dividing by the full width. Its backward sums the gradients of that all-reduce, so tp_size 2 == tp_size 1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from colossalai.shardformer.layer.parallel_module import ParallelModule
from colossalai.shardformer.policies.base_policy import SubModuleReplacementDescription
from colossalai.tensor.d_tensor.api import (
    is_distributed_tensor,
    shard_rowwise,
    sharded_tensor_to_existing_param,
)
from torch import nn
from torch.distributed import ProcessGroup
from transformers.models.olmo3.modeling_olmo3 import Olmo3DecoderLayer, Olmo3ForCausalLM, Olmo3Model

from coati_kto.families.shardformer.base import DecoderPolicy


class _SumWithGradient(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient: each rank's input reaches every rank's output."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def sum_with_gradient(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The sum of ``tensor`` over ``group``, differentiable (torch.distributed.nn's all_reduce, deprecated, warns
    on every run). Every rank of ``group`` calls it, forward and backward, in the same order."""
    return _SumWithGradient.apply(tensor, group)


class RMSNormAcrossRanks(ParallelModule):
    """An RMSNorm over a feature dimension split across ``process_group`` (contiguous slices, rank order): each
    rank normalises its slice with the mean of squares of the whole width. Gathered on save like Linear1D_Col."""

    def __init__(self, weight: nn.Parameter, eps: float, process_group: Any) -> None:
        super().__init__()
        self.process_group, self.variance_epsilon = process_group, eps
        self.full_width = weight.shape[0]
        self.weight = weight
        if not is_distributed_tensor(self.weight):
            with torch.no_grad():
                sharded_tensor_to_existing_param(shard_rowwise(self.weight.data, process_group), self.weight)

    @staticmethod
    def from_native_module(
        module: nn.Module, process_group: Any, *args: Any, **kwargs: Any
    ) -> RMSNormAcrossRanks:
        group = process_group[0] if isinstance(process_group, (list, tuple)) else process_group
        return RMSNormAcrossRanks(module.weight, module.variance_epsilon, group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        squares = sum_with_gradient(hidden_states.pow(2).sum(-1, keepdim=True), self.process_group)
        hidden_states = hidden_states * torch.rsqrt(squares / self.full_width + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class _WholeProjectionNorms(DecoderPolicy):
    """Llama's module names, plus q/k norms over the whole projection split with q_proj / k_proj."""

    def module_policy(self) -> dict[Any, Any]:
        policy = super().module_policy()
        if self.shard_config.enable_tensor_parallelism:
            policy[self.decoder_layer].sub_module_replacement += [
                SubModuleReplacementDescription(suffix, RMSNormAcrossRanks)
                for suffix in ("self_attn.q_norm", "self_attn.k_norm")
            ]
        return policy


class Olmo3ForCausalLMPolicy(_WholeProjectionNorms):
    causal_lm = Olmo3ForCausalLM
    base_model = Olmo3Model
    decoder_layer = Olmo3DecoderLayer
