"""Gemma 3 (text): the project's shardformer policy, tp_size 1 only.

At tp_size 1 the policy swaps nothing (transformers 5's forward, its scaled embedding, its (1 + w) RMSNorm and
soft-capping as they are), which the lifecycle matrix proves. Tensor parallelism is refused at config load:
it would need a vocabulary-parallel embedding that keeps Gemma's ``embed_scale`` and the per-head q/k norm
gradient sum (as Qwen3's), and no test proves that yet.
"""

from __future__ import annotations

from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3TextModel,
)

from coati_kto.families.shardformer.base import DecoderPolicy


class Gemma3ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Gemma3ForCausalLM
    base_model = Gemma3TextModel
    decoder_layer = Gemma3DecoderLayer
    per_head_replicated = ("self_attn.q_norm", "self_attn.k_norm")

    def config_sanity_check(self) -> None:
        super().config_sanity_check()
        if self.shard_config.enable_tensor_parallelism:
            raise ValueError("Gemma3ForCausalLMPolicy: tensor parallelism is not supported (tp_size 1 only)")
