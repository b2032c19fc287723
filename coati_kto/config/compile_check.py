"""Where ``model.compile`` and ``train.fused_optimizer`` (the compiled regions) are refused at config load: what
each is not proven on, one line each."""

from __future__ import annotations

from typing import Any


def compile_problems(config: Any) -> list[str]:
    """Problems of a ``Config`` (duck-typed: this module is imported by the schema) with ``model.compile`` on.

    Proven (tests/distributed/test_compile.py, tests/unit/models/test_compiled_model.py): hybrid_parallel at
    tp_size 1, low_level_zero and ddp; full fine-tuning; sdpa or eager attention; padding-free rows;
    activation checkpointing.
    """
    if config.model.compile is False:
        return fused_optimizer_problems(config)
    why = []
    if config.plugin.name == "gemini" or config.plugin.tp_size > 1:
        why.append(f"plugin {config.plugin.name} tp_size {config.plugin.tp_size}")
    if config.model.lora is not None:
        why.append("model.lora")
    if config.model.attn_implementation in ("flex_attention", "flash_attention_2"):
        why.append(f"model.attn_implementation {config.model.attn_implementation}")
    return [
        f"model.compile is not proven with {w} (set model.compile=false; proven: hybrid_parallel tp_size 1, "
        "low_level_zero, ddp)"
        for w in why
    ] + fused_optimizer_problems(config)


def fused_optimizer_problems(config: Any) -> list[str]:
    """``train.fused_optimizer`` on what it is not proven on (tests/distributed/test_mixed_adamw.py proves bf16
    hybrid_parallel at tp_size 1 and low_level_zero, ZeRO 0 to 2, full fine-tuning, fp32 AdamW states)."""
    if not config.train.fused_optimizer:
        return []
    plugin, why = config.plugin, []
    if plugin.name not in ("hybrid_parallel", "low_level_zero") or plugin.precision != "bf16":
        why.append(f"plugin {plugin.name} precision {plugin.precision} (it fuses bf16 masters' casts)")
    if plugin.tp_size > 1 or plugin.cpu_offload:
        why.append(f"plugin.tp_size {plugin.tp_size} cpu_offload {plugin.cpu_offload}")
    if config.train.optimizer_state_dtype != "fp32" or config.model.lora is not None:
        why.append(f"train.optimizer_state_dtype {config.train.optimizer_state_dtype} or model.lora")
    return [
        f"train.fused_optimizer is not proven with {w} (set train.fused_optimizer=false; proven: bf16 "
        "hybrid_parallel tp_size 1 and low_level_zero, fp32 states, no LoRA, no cpu_offload)"
        for w in why
    ]
