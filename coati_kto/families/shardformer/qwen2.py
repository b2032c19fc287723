"""Qwen2: the project's shardformer policy (transformers 5's own forwards; see coati_kto.families.shardformer.base)."""

from __future__ import annotations

from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2Model

from coati_kto.families.shardformer.base import DecoderPolicy


class Qwen2ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Qwen2ForCausalLM
    base_model = Qwen2Model
    decoder_layer = Qwen2DecoderLayer
