"""Mistral: the project's shardformer policy (transformers 5's own forwards; see coati_kto.families.shardformer.base)."""

from __future__ import annotations

from transformers.models.mistral.modeling_mistral import MistralDecoderLayer, MistralForCausalLM, MistralModel

from coati_kto.families.shardformer.base import DecoderPolicy


class MistralForCausalLMPolicy(DecoderPolicy):
    causal_lm = MistralForCausalLM
    base_model = MistralModel
    decoder_layer = MistralDecoderLayer
