"""Model types the family sweep (docs/family_sweep.md) does not prove: refused at config load on every plugin,
each with what the sweep found. Those that build and train but fail its checks (no run trains a model whose
export or first step is known to be wrong), and those it cannot build as their checkpoints are built or whose
model needs an input a text KTO batch lacks (nothing proves they train). A type leaves this table when the sweep
(tests/distributed/family_sweep.py) passes it.
"""

from __future__ import annotations

from typing import Any

_STEP1_NOT_ZERO = (
    "its first step's rewards are not 0 with the policy equal to the reference ({} apart in the sweep: its "
    "gradient and no-gradient forwards differ), so the KTO reference point is off"
)
_FP32_ROUTER = (
    "its MoE router casts the hidden states to fp32 for an fp32 weight, but ZeRO trains the router in the working "
    "dtype (one dtype per optimizer), so the sweep's bf16 step fails: 'expected m1 and m2 to have the same dtype' "
    "({})"
)
_NOT_TEXT = "{} is no text causal LM: its forward takes {}, not the token ids of a text KTO batch"
# model_type -> what fails (transformers 5.24, both plugins, ZeRO-2 bf16 and fp32 alike).
UNPROVEN_TYPES: dict[str, str] = {
    "youtu": (
        "transformers zeroes the pad_token_id row of the embeddings (tied to the LM head) on every load "
        "(YoutuPreTrainedModel._init_weights writes through .data), so an exported model does not reload as "
        "trained (0.03 apart in the sweep)"
    ),
    "doge": _STEP1_NOT_ZERO.format("1e-4"),
    "inkling_text": _STEP1_NOT_ZERO.format("4e-6"),
    # Types the sweep cannot build as a checkpoint is built, or whose model needs what a text KTO batch lacks.
    "xlnet": (
        "XLNetLMHeadModel attends both ways (attn_type bi: the sweep's logits moved when a later token changed), "
        "so a completion's log-probs would read the completion itself (KTO needs a causal LM)"
    ),
    "reformer": (
        "in training its axial position embeddings need every batch exactly prod(axial_pos_shape) tokens long "
        "(4,096 by default), which KTO's padded batches of any length are not"
    ),
    "xmod": (
        "X-MOD routes every row through a language adapter named by lang_ids (or default_language), which a "
        "text KTO batch does not carry ('Input language unknown' in the sweep)"
    ),
    "musicgen": _NOT_TEXT.format("MusicGen", "EnCodec audio codes, num_codebooks rows per example"),
    "musicgen_melody": _NOT_TEXT.format(
        "MusicGen Melody", "EnCodec audio codes, num_codebooks rows per example"
    ),
    "gemma4_assistant": _NOT_TEXT.format(
        "a Gemma 4 assistant (a speculative-decoding drafter)",
        "the target model's inputs_embeds and shared_kv_states",
    ),
    "gemma4_unified_assistant": _NOT_TEXT.format(
        "a Gemma 4 unified assistant (a speculative-decoding drafter)",
        "the target model's inputs_embeds and shared_kv_states",
    ),
    "inkling2_text": _FP32_ROUTER.format("modeling_inkling2.py:811"),
    "inkling2_loop_text": _FP32_ROUTER.format("modeling_inkling2_loop.py:1167"),
    "llama4": (
        "transformers' Llama4ForConditionalGeneration fails on every forward ('MoeCausalLMOutputWithPast' object "
        "has no attribute 'image_outputs', modeling_llama4.py), so the sweep could not build it; Llama 4's text "
        "model (llama4_text) trains"
    ),
    "gemma3n": (
        "its vision tower is timm's MobileNetV5 (TimmWrapperModel) and timm is no dependency of this project, so "
        "the sweep could not build it; Gemma 3n's text model (gemma3n_text) trains"
    ),
    "emu3": (
        "its model maps image tokens to the tokenizer's visual tokens through config.vocabulary_map, which its "
        "default config leaves None and the sweep's tokenizer has none for, so the sweep could not build it"
    ),
}


def unproven_refusal(raw: dict[str, Any]) -> str | None:
    """Why the model of config.json ``raw`` is refused as failing the family sweep (None when it is not)."""
    model_type = raw.get("model_type")
    if model_type not in UNPROVEN_TYPES:
        return None
    return f"model_type {model_type} is not supported: {UNPROVEN_TYPES[model_type]} (docs/family_sweep.md)"
