"""Gemma 3 (text): the project's shardformer policy.

At tp_size 1 the policy swaps nothing (transformers 5's forward, its scaled embedding, its (1 + w) RMSNorm and
soft-capping as they are). Under tensor parallelism it swaps the Llama-shaped modules (coati_kto.families.
shardformer.base), sums the per-head q/k norms' gradients over the tensor-parallel group (as Qwen3's), and keeps
Gemma's ``embed_scale`` on the vocabulary-parallel embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from colossalai.shardformer.layer import VocabParallelEmbedding1D
from transformers.models.gemma3.modeling_gemma3 import (
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3TextModel,
)

from coati_kto.families.shardformer.base import DecoderPolicy, VocabParallelEmbedding


class ScaledVocabParallelEmbedding1D(VocabParallelEmbedding):
    """Gemma's scaled word embedding sliced over the vocabulary: the gathered lookup times ``embed_scale``."""

    @staticmethod
    def from_native_module(module: torch.nn.Module, process_group: Any, *args: Any, **kwargs: Any) -> Any:
        parallel = VocabParallelEmbedding1D.from_native_module(module, process_group, *args, **kwargs)
        parallel.__class__ = ScaledVocabParallelEmbedding1D
        # A derived constant, like transformers' own (non-persistent: never saved nor trained).
        parallel.register_buffer("embed_scale", module.embed_scale.detach().clone(), persistent=False)
        return parallel

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        return super().forward(input_) * self.embed_scale.to(self.weight.dtype)


class Gemma3ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Gemma3ForCausalLM
    base_model = Gemma3TextModel
    decoder_layer = Gemma3DecoderLayer
    per_head_replicated = ("self_attn.q_norm", "self_attn.k_norm")
    embedding_cls = ScaledVocabParallelEmbedding1D
