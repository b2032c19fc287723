"""Qwen3: the project's shardformer policy (transformers 5's own forwards; see coati_kto.families.shardformer.base).

Qwen3's attention normalises each query and key head with one RMSNorm weight of size head_dim shared by all heads
(``q_norm``, ``k_norm``). Under tensor parallelism each rank holds its own heads, so each rank's gradient of
those weights covers only its heads: the policy sums them over the tensor-parallel group. Without that sum the
replicas drift apart and tp_size 2 no longer equals tp_size 1 (tests/test_tp_equivalence.py).
"""

from __future__ import annotations

from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model

from coati_kto.families.shardformer.base import DecoderPolicy


class Qwen3ForCausalLMPolicy(DecoderPolicy):
    causal_lm = Qwen3ForCausalLM
    base_model = Qwen3Model
    decoder_layer = Qwen3DecoderLayer
    per_head_replicated = ("self_attn.q_norm", "self_attn.k_norm")
