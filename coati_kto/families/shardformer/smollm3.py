"""SmolLM3: the project's shardformer policy (transformers 5's own forwards; see coati_kto.families.shardformer.base).

Llama's module names; its layers without RoPE (``no_rope_layers``) change the forward only, which the policy keeps.
"""

from __future__ import annotations

from transformers.models.smollm3.modeling_smollm3 import (
    SmolLM3DecoderLayer,
    SmolLM3ForCausalLM,
    SmolLM3Model,
)

from coati_kto.families.shardformer.base import DecoderPolicy


class SmolLM3ForCausalLMPolicy(DecoderPolicy):
    causal_lm = SmolLM3ForCausalLM
    base_model = SmolLM3Model
    decoder_layer = SmolLM3DecoderLayer
