"""Shardformer policies the project owns, one module per family, and the families hybrid_parallel admits.

``HYBRID_FAMILIES`` is the honest list: a causal-LM class is admitted under ``plugin.name: hybrid_parallel``
at a tp_size only where tests/test_families.py (the lifecycle: step-0 rewards 0, bit-exact resume, export) and
tests/test_tp_equivalence.py (tp_size 2 == tp_size 1) prove it. This module imports neither ColossalAI nor
transformers' model code, so the config check stays fast; ``policy_for`` imports the family's policy.
"""

from __future__ import annotations

import importlib
from typing import Any

# Architecture class name -> (policy module under coati_kto.families.shardformer, policy class, proven tp sizes).
HYBRID_FAMILIES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLMPolicy", (1, 2)),
    "MistralForCausalLM": ("mistral", "MistralForCausalLMPolicy", (1, 2)),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLMPolicy", (1, 2)),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLMPolicy", (1, 2)),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLMPolicy", (1, 2)),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLMPolicy", (1, 2)),
}


def supported_summary() -> str:
    """One line: each admitted class with its tp sizes, e.g. ``LlamaForCausalLM (tp_size 1, 2)``."""
    return ", ".join(
        f"{name} (tp_size {', '.join(map(str, tps))})" for name, (_, _, tps) in HYBRID_FAMILIES.items()
    )


def hybrid_refusal(architecture: str, tp_size: int) -> str | None:
    """Why ``architecture`` cannot run under hybrid_parallel at ``tp_size`` (one line), or None when admitted."""
    entry = HYBRID_FAMILIES.get(architecture)
    if entry is None:
        return f"{architecture} is not supported under plugin.name hybrid_parallel"
    if tp_size not in entry[2]:
        return f"{architecture} is not supported under plugin.name hybrid_parallel at tp_size {tp_size}"
    return None


def policy_for(model_class: str | None) -> Any:
    """A new instance of the project's policy for ``model_class`` (a class name, bare or with its module), or
    None when the class is not one of ``HYBRID_FAMILIES``."""
    entry = HYBRID_FAMILIES.get((model_class or "").rsplit(".", 1)[-1])
    if entry is None:
        return None
    module = importlib.import_module(f"{__name__}.{entry[0]}")
    return getattr(module, entry[1])()
