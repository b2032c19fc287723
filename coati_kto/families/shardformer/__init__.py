"""Shardformer policies the project owns, one module per family, and which classes tensor parallelism admits.

At tp_size 1 every family is admitted through one policy that swaps nothing (``unsharded.UnshardedPolicy``: ZeRO
alone, as without shardformer; tests/distributed/test_family_sweep.py runs every causal-LM type transformers builds).
``TENSOR_PARALLEL_FAMILIES`` is the honest list for tp_size > 1: a class is admitted at a tp_size only where
tests/distributed/test_families.py (the lifecycle: step-0 rewards 0, bit-exact resume, export) and
tests/distributed/test_tp_equivalence.py (tp_size 2 == tp_size 1) prove it; tests/distributed/test_layouts_4_families.py
runs every class admitted at tp_size 2 on tp 2 x dp 2 against tp 1 x dp 4. This module imports neither ColossalAI
nor transformers' model code, so the config check stays fast; ``policy_for`` imports the policy.
"""

from __future__ import annotations

import importlib
from typing import Any

# Architecture class name -> (policy module under coati_kto.families.shardformer, policy class, proven tp sizes > 1).
TENSOR_PARALLEL_FAMILIES: dict[str, tuple[str, str, tuple[int, ...]]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLMPolicy", (2,)),
    "MistralForCausalLM": ("mistral", "MistralForCausalLMPolicy", (2,)),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLMPolicy", (2,)),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLMPolicy", (2,)),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLMPolicy", (2,)),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLMPolicy", (2,)),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLMPolicy", (2,)),
    "Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLMPolicy", (2,)),
    "Gemma4ForCausalLM": ("gemma4", "Gemma4ForCausalLMPolicy", (2,)),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen35ForCausalLMPolicy", (2,)),
    "Gemma4ForConditionalGeneration": ("gemma4", "Gemma4ForConditionalGenerationPolicy", (2,)),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "Qwen35ForConditionalGenerationPolicy", (2,)),
}

# Classes admitted under all_to_all sequence parallelism, with their proven sp sizes (plugin.sp_size > 1): the
# attention wrapper of coati_kto.parallel.sequence changes no layer, so a class needs only the proof
# (tests/distributed/test_sequence_parallel.py: sp 2 == sp 1 per-row log-probs, logit means and gradients on
# packed rows, Llama also at sp 4; for Llama the whole recipe too, test_sequence_parallel_train.py and _layouts_4.py). Sequence
# parallelism runs on padding-free rows only: Phi-3, Olmo 3 and Gemma 4 take none (no chunked head, or no 4D masks
# for their layers), and Qwen 3.5's linear-attention layers recur over the whole sequence.
SEQUENCE_PARALLEL_FAMILIES: dict[str, tuple[int, ...]] = {
    "LlamaForCausalLM": (2, 4),
    "MistralForCausalLM": (2,),
    "Qwen2ForCausalLM": (2,),
    "Qwen3ForCausalLM": (2,),
    "Gemma3ForCausalLM": (2,),
    "SmolLM3ForCausalLM": (2,),
}

# Classes admitted under pipeline parallelism, with their pp sizes (plugin.pp_size > 1): ColossalAI's pipeline
# forwards are written for transformers 4.51, so every stage runs the project's own stage forward on the decoder
# shape of transformers 5 (docs/pipeline_parallelism_plan.md, §3); a class is added where its tests prove it.
PIPELINE_PARALLEL_FAMILIES: dict[str, tuple[int, ...]] = {
    "LlamaForCausalLM": (2, 4),
    "MistralForCausalLM": (2,),
    "Qwen2ForCausalLM": (2, 4),
    "Qwen3ForCausalLM": (2,),
    "SmolLM3ForCausalLM": (2,),
}

# Classes whose tensor-parallel policy splits fused projections part by part (Phi-3's qkv_proj, gate_up_proj;
# Qwen 3.5's linear-attention in_proj_qkv and conv1d):
# ColossalAI 0.5.0's checkpoint gathers their optimizer moments rank after rank ([q0 k0 v0 | q1 k1 v1]), not in
# transformers' order, so the moments only fit the tp_size they were saved at.
FUSED_PROJECTIONS = frozenset({"Phi3ForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"})


def tp_change_refusal(architecture: str, saved_tp: int | None, tp_size: int) -> str | None:
    """Why a checkpoint saved at ``saved_tp`` cannot resume ``architecture`` at ``tp_size`` (None when it can)."""
    if saved_tp is None or saved_tp == tp_size or architecture not in FUSED_PROJECTIONS:
        return None
    return (
        f"{architecture}'s fused projections were saved at plugin.tp_size {saved_tp}: their optimizer moments "
        f"resume at that tp_size only (set plugin.tp_size {saved_tp}, or start a new run from an export)"
    )


def supported_summary() -> str:
    """One line: each class admitted under tensor parallelism with its tp sizes, e.g. ``LlamaForCausalLM (tp_size
    2)``."""
    return ", ".join(
        f"{name} (tp_size {', '.join(map(str, tps))})"
        for name, (_, _, tps) in TENSOR_PARALLEL_FAMILIES.items()
    )


def tensor_parallel_refusal(architecture: str, tp_size: int) -> str | None:
    """Why ``architecture`` cannot be split over ``tp_size`` tensor-parallel ranks (one line), or None when admitted:
    every class at tp_size 1, the proven ``TENSOR_PARALLEL_FAMILIES`` above it."""
    if tp_size <= 1:
        return None
    entry = TENSOR_PARALLEL_FAMILIES.get(architecture)
    if entry is None:
        return f"{architecture} has no tensor-parallel policy (plugin.tp_size {tp_size})"
    if tp_size not in entry[2]:
        return f"{architecture} is not supported at plugin.tp_size {tp_size}"
    return None


def sequence_parallel_refusal(architecture: str, sp_size: int) -> str | None:
    """Why ``architecture`` cannot run at ``sp_size`` sequence-parallel ranks (one line), or None when admitted."""
    return _unproven(architecture, sp_size, SEQUENCE_PARALLEL_FAMILIES, "sp_size", "sequence parallelism")


def pipeline_parallel_refusal(architecture: str, pp_size: int) -> str | None:
    """Why ``architecture`` cannot run at ``pp_size`` pipeline stages (one line), or None when admitted."""
    return _unproven(architecture, pp_size, PIPELINE_PARALLEL_FAMILIES, "pp_size", "pipeline parallelism")


def _unproven(
    architecture: str, size: int, table: dict[str, tuple[int, ...]], key: str, what: str
) -> str | None:
    """Why ``architecture`` is not admitted at ``size`` by ``table`` (class -> proven sizes > 1), or None."""
    if size <= 1 or size in table.get(architecture, ()):
        return None
    admitted = ", ".join(f"{k} ({key} {', '.join(map(str, v))})" for k, v in table.items())
    return f"{architecture} is not proven at plugin.{key} {size} ({what}: {admitted})"


def policy_for(model_class: str | None, tp_size: int = 1) -> Any:
    """A new instance of the policy for ``model_class`` (a class name, bare or with its module) at ``tp_size``:
    the one that swaps nothing at tp_size 1 (every class), the family's own above it, None when it has none."""
    if tp_size <= 1:
        from coati_kto.families.shardformer.unsharded import UnshardedPolicy

        return UnshardedPolicy()
    entry = TENSOR_PARALLEL_FAMILIES.get((model_class or "").rsplit(".", 1)[-1])
    if entry is None:
        return None
    module = importlib.import_module(f"{__name__}.{entry[0]}")
    return getattr(module, entry[1])()
