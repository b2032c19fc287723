"""The project's tensor-parallel policy for Llama-shaped decoders, run with transformers' own forwards.

Why not ColossalAI 0.5.0's policies: they replace the model's forward with copies written for transformers
4.51, which under transformers 5 fail to import (``StaticCache``), call ``_update_causal_mask`` (gone), or take
``layer_outputs[0]`` from decoder layers that now return a tensor (batch row 0, silently, at micro-batch 1).
Transformers 5's attention reshapes with ``view(*shape, -1, head_dim)`` and repeats key-value heads by the
ratio ``num_key_value_groups``, so its own forward runs unchanged on a rank holding 1/tp of the heads: the policy
only has to swap modules, never forwards. Under pipeline parallelism the forward is the project's stage forward
(``pipeline.PipelineStages``); ColossalAI's sequence-parallel forwards are not used (all_to_all wraps the kernel).

What the policy swaps, under tensor parallelism only: q/k/v and gate/up projections column-parallel, o/down
row-parallel (one all-reduce each), the embedding vocabulary-parallel, the LM head vocabulary-parallel with the
logits gathered and unpadded (``parallel_output=False``: the log-prob code needs whole vocabulary rows). At
tp_size 1 nothing is swapped: transformers' modules as they are, no padded vocabulary to unpad at save time.
Flash attention comes from transformers (``attn_implementation``), not from ColossalAI's kernels.

Parameters that act on a rank's own heads but are replicated (per-head q/k norms) get partial gradients on each
rank: ``per_head_replicated`` names them, and ``postprocess`` registers a gradient hook summing them over the
tensor-parallel group, so every rank applies the same, full gradient (tp_size 2 == tp_size 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from colossalai.shardformer.layer import (
    FusedLinear1D_Col,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
)
from colossalai.shardformer.layer._operation import reduce_forward
from colossalai.shardformer.policies.base_policy import (
    ModulePolicyDescription,
    Policy,
    SubModuleReplacementDescription,
)
from torch import nn

from coati_kto.families.shardformer.pipeline import PipelineStages

COLUMN_PARALLEL = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


class VocabParallelEmbedding(VocabParallelEmbedding1D):
    """ColossalAI's vocabulary-parallel embedding (each tensor-parallel rank looks up the ids in its slice, zeros
    the others, the group sums), masking with ``torch.where`` / ``masked_fill`` instead of boolean indexing: the
    same values and gradients, without the host syncs a boolean index costs on CUDA (2 per forward and 1 per
    backward: 18 per optimizer step of the tests' tp 2 run, against the step's 1)."""

    @staticmethod
    def from_native_module(module: nn.Module, process_group: Any, *args: Any, **kwargs: Any) -> Any:
        parallel = VocabParallelEmbedding1D.from_native_module(module, process_group, *args, **kwargs)
        parallel.__class__ = VocabParallelEmbedding
        return parallel

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        ids = torch.where(outside, 0, input_ - self.vocab_start_index)
        looked_up = nn.functional.embedding(
            ids, self.weight, self.padding_idx, *self.embed_args, **self.embed_kwargs
        )
        mine = looked_up.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_forward(mine, self.process_group, fp8_communication=self.fp8_communication)


class DecoderPolicy(PipelineStages, Policy):
    """Tensor-parallel sharding of a ``...ForCausalLM`` whose layers follow Llama's module names.

    Subclasses set ``causal_lm`` / ``base_model`` / ``decoder_layer`` (the transformers classes) and may set
    ``per_head_replicated`` (suffixes under a decoder layer whose gradients are summed over the tensor-parallel
    group), ``embedding_cls`` (the vocabulary-parallel embedding), ``column_parallel`` / ``row_parallel`` (the
    projections split by output / input) and ``fused_column`` (fused projections, each split part by part so
    that every rank holds its own slice of each part: ``{suffix: split_sizes(config)}``).
    """

    causal_lm: type[nn.Module]
    base_model: type[nn.Module]
    decoder_layer: type[nn.Module]
    per_head_replicated: tuple[str, ...] = ()
    embedding_cls: type[nn.Module] = VocabParallelEmbedding
    column_parallel: tuple[str, ...] = COLUMN_PARALLEL
    row_parallel: tuple[str, ...] = ROW_PARALLEL
    fused_column: dict[str, Any] = {}
    # Suffixes some layers lack (Gemma 4's v_proj under attention_k_eq_v, k/v in kv-shared layers; Qwen 3.5's
    # self_attn in linear-attention layers): replaced where present.
    optional: tuple[str, ...] = ()

    def config_sanity_check(self) -> None:
        config = self.shard_config
        # all_to_all sequence parallelism changes no module here: the parallel backend wraps the attention kernel.
        other_sp = config.enable_sequence_parallelism and config.sequence_parallelism_mode != "all_to_all"
        if other_sp:
            raise ValueError(
                f"{type(self).__name__} supports all_to_all sequence parallelism only (no other sequence-parallel "
                "mode)"
            )

    def preprocess(self) -> nn.Module:
        return self.model

    def module_policy(self) -> dict[Any, ModulePolicyDescription]:
        return self.with_stage_forward(self._tensor_parallel_policy(), self.causal_lm)

    def _tensor_parallel_policy(self) -> dict[Any, ModulePolicyDescription]:
        config = self.shard_config
        if not config.enable_tensor_parallelism:
            return {}
        model_config = self.model.config.get_text_config()  # a vision-language model's text model is split
        tp = config.tensor_parallel_size
        uneven = {k: v for k, v in self.split_counts(model_config).items() if v % tp}
        if uneven:
            # One line for the user: the split must keep whole heads (and whole key-value groups) per rank.
            raise ValueError(f"tp_size {tp} must divide {', '.join(f'{k} {v}' for k, v in uneven.items())}")
        fp8 = {"fp8_communication": config.fp8_communication}
        layers = [self._replace(s, Linear1D_Col, fp8) for s in self.column_parallel]
        layers += [self._replace(s, Linear1D_Row, fp8) for s in self.row_parallel]
        layers += [
            self._replace(s, FusedLinear1D_Col, {"split_sizes": sizes(model_config), **fp8})
            for s, sizes in self.fused_column.items()
        ]
        vocab = {"make_vocab_size_divisible_by": config.make_vocab_size_divisible_by, **fp8}
        return {
            self.decoder_layer: ModulePolicyDescription(sub_module_replacement=layers),
            self.base_model: ModulePolicyDescription(
                sub_module_replacement=[
                    SubModuleReplacementDescription("embed_tokens", self.embedding_cls, kwargs=vocab)
                ]
            ),
            self.causal_lm: ModulePolicyDescription(
                sub_module_replacement=[
                    SubModuleReplacementDescription(
                        "lm_head",
                        VocabParallelLMHead1D,
                        kwargs={"gather_output": not config.parallel_output, **vocab},
                    )
                ]
            ),
        }

    def split_counts(self, model_config: Any) -> dict[str, int]:
        """The counts tensor parallelism splits (heads, widths): each must divide by tp_size."""
        return {
            "num_attention_heads": model_config.num_attention_heads,
            "num_key_value_heads": model_config.num_key_value_heads,
        }

    def _replace(self, suffix: str, layer: type, kwargs: dict[str, Any]) -> SubModuleReplacementDescription:
        return SubModuleReplacementDescription(
            suffix, layer, kwargs=kwargs, ignore_if_not_exist=suffix in self.optional
        )

    def postprocess(self) -> nn.Module:
        config = self.shard_config
        if config.enable_tensor_parallelism and config.tensor_parallel_size > 1:
            for param in replicated_per_head_parameters(
                self.model, self.decoder_layer, self.per_head_replicated
            ):
                sum_gradient_over(param, config.tensor_parallel_process_group)
        return self.model


def replicated_per_head_parameters(
    model: nn.Module, layer_cls: type[nn.Module], suffixes: tuple[str, ...]
) -> list[nn.Parameter]:
    """The parameters under every ``layer_cls`` module of ``model`` whose names start with one of ``suffixes``."""
    found = []
    for layer in model.modules():
        if isinstance(layer, layer_cls):
            found += [p for n, p in layer.named_parameters() if n.startswith(suffixes)]
    return found


def sum_gradient_over(param: nn.Parameter, group: Any) -> None:
    """Make ``param``'s gradient the sum over ``group`` of each rank's gradient.

    A tensor hook runs on each backward's gradient before it is accumulated into ``.grad`` (and before ZeRO's
    post-accumulate hooks move it into its buckets), so accumulation, ZeRO and clipping all see the summed value.
    Idempotent per parameter.
    """
    if getattr(param, "_coati_tp_summed", False):
        return

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # the incoming gradient may be shared with other consumers of the graph
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
        return grad

    param.register_hook(summed)
    param._coati_tp_summed = True  # type: ignore[attr-defined]
