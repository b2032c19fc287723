"""Llama: the project's shardformer policy (transformers 5's own forwards; see coati_kto.families.shardformer.base)."""

from __future__ import annotations

from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

from coati_kto.families.shardformer.base import DecoderPolicy


class LlamaForCausalLMPolicy(DecoderPolicy):
    causal_lm = LlamaForCausalLM
    base_model = LlamaModel
    decoder_layer = LlamaDecoderLayer
