"""Gemma 4 (text): the project's shardformer policy (transformers 5's own forwards; see
coati_kto.families.shardformer.base).

Under tensor parallelism it splits q/k/v and gate/up by output rows and o/down by input rows, sums the per-head
q/k norms' gradients over the tensor-parallel group (as Gemma 3's) and keeps ``embed_scale`` on the
vocabulary-parallel embedding. What Gemma 4 adds, and why each stays exact:
- sliding and full layers with their own head_dim (``global_head_dim``) and key-value heads
  (``num_global_key_value_heads``): split by whole heads per layer (``split_counts``: every count must divide);
- ``attention_k_eq_v`` (full layers: values are the keys, no v_proj) and kv-shared layers (no k/v projections or
  norms: they reuse an earlier layer's keys and values, which hold the same heads on each rank): the missing
  modules are skipped (``optional``); v_norm has no weight;
- per-layer inputs (PLE: ``embed_tokens_per_layer``, ``per_layer_model_projection``, each layer's gate and
  projection) stay replicated: they read and write the residual stream, whole on every rank, so every rank
  computes them and their full gradients alike;
- final logit soft-capping runs on the gathered logits (transformers' forward); the double-wide MLP of kv-shared
  layers splits like any MLP.
The MoE variant (``enable_moe_block``, 26B-A4B) is refused above tp_size 1: its experts are not split.
"""

from __future__ import annotations

from typing import Any

from transformers.models.gemma4.modeling_gemma4 import (
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextDecoderLayer,
    Gemma4TextModel,
)

from coati_kto.families.shardformer.base import COLUMN_PARALLEL, DecoderPolicy
from coati_kto.families.shardformer.gemma3 import ScaledVocabParallelEmbedding1D


def gemma4_split_counts(config: Any) -> dict[str, int]:
    """Every head count and MLP width a tensor-parallel split of ``config`` (a Gemma4TextConfig) divides."""
    counts = {
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
    }
    for layer in range(config.num_hidden_layers):  # per layer type (full layers: num_global_key_value_heads)
        counts[f"layer {layer}'s num_key_value_heads"] = config.per_layer_config[layer].num_key_value_heads
    return counts


class Gemma4ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Gemma4ForCausalLM
    base_model = Gemma4TextModel
    decoder_layer = Gemma4TextDecoderLayer
    per_head_replicated = ("self_attn.q_norm", "self_attn.k_norm")
    embedding_cls = ScaledVocabParallelEmbedding1D
    optional = ("self_attn.k_proj", "self_attn.v_proj")
    column_parallel = COLUMN_PARALLEL

    def module_policy(self) -> dict[Any, Any]:
        if self.shard_config.enable_tensor_parallelism and getattr(
            self.model.config, "enable_moe_block", False
        ):
            raise ValueError(
                "Gemma 4 with enable_moe_block (26B-A4B) has no tensor-parallel policy: tp_size 1"
            )
        return super().module_policy()

    def split_counts(self, model_config: Any) -> dict[str, int]:
        return gemma4_split_counts(model_config)


class Gemma4ForConditionalGenerationPolicy(Gemma4ForCausalLMPolicy):
    """The hub checkpoints' class: its language model split as above, lm_head at the top; the vision (and
    audio) towers replicated (frozen: the text passes never reach them)."""

    causal_lm = Gemma4ForConditionalGeneration
