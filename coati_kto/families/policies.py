"""Shardformer policies the project corrects, keyed by the full model class name (``corrected_policy``).

Imported by the parallel plan when it builds the plugin; ColossalAI is imported inside the functions (its
import costs 3-4 s and the config checks must not pay it).
"""

from __future__ import annotations

from typing import Any

QWEN2_CAUSAL_LM = "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM"


def corrected_policy(model_class: str | None) -> Any:
    """A corrected shardformer policy for ``model_class``, or None (ColossalAI picks its own).

    ColossalAI 0.5.0's Qwen2ForCausalLM policy leaves the LM head of Llama's and Mistral's policies out: under
    tensor parallelism its head is a plain column-parallel linear that returns vocabulary-sharded, padded
    logits whatever ``parallel_output`` says; with tp_size 1 and tied embeddings the embedding is padded to a
    multiple of 64 and the untouched head returns the padding columns as logits (log-probs off by about 2
    nats on a tiny model, padding rows trained, resume not exact). The corrected policy uses the heads the
    Llama policy uses: VocabParallelLMHead1D (gathers and unpads) or PaddingLMHead (unpads).
    """
    if model_class != QWEN2_CAUSAL_LM:
        return None
    from colossalai.shardformer.layer import PaddingLMHead, VocabParallelLMHead1D
    from colossalai.shardformer.policies.base_policy import (
        ModulePolicyDescription,
        SubModuleReplacementDescription,
    )
    from colossalai.shardformer.policies.qwen2 import Qwen2ForCausalLMPolicy
    from transformers import Qwen2ForCausalLM

    class Qwen2ForCausalLMUnpaddedPolicy(Qwen2ForCausalLMPolicy):
        def module_policy(self) -> dict:
            policy = super().module_policy()
            config = self.shard_config
            if config.enable_tensor_parallelism:
                head = SubModuleReplacementDescription(
                    suffix="lm_head",
                    target_module=VocabParallelLMHead1D,
                    kwargs={
                        "gather_output": not config.parallel_output,
                        "make_vocab_size_divisible_by": config.make_vocab_size_divisible_by,
                        "fp8_communication": config.fp8_communication,
                    },
                )
            else:
                head = SubModuleReplacementDescription(
                    suffix="lm_head",
                    target_module=PaddingLMHead,
                    kwargs={"make_vocab_size_divisible_by": config.make_vocab_size_divisible_by},
                )
            described = policy.setdefault(
                Qwen2ForCausalLM, ModulePolicyDescription(sub_module_replacement=[])
            )
            others = [d for d in described.sub_module_replacement or [] if d.suffix != "lm_head"]
            described.sub_module_replacement = [*others, head]
            return policy

    return Qwen2ForCausalLMUnpaddedPolicy()
