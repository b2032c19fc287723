"""Where ``model.compile`` is refused at config load: what it is not proven on, one line each."""

from __future__ import annotations

from typing import Any


def compile_problems(config: Any) -> list[str]:
    """Problems of a ``Config`` (duck-typed: this module is imported by the schema) with ``model.compile`` on.

    Proven (tests/distributed/test_compile.py, tests/unit/models/test_compiled_model.py): hybrid_parallel at
    tp_size 1, low_level_zero and ddp; full fine-tuning; sdpa or eager attention; padding-free rows;
    activation checkpointing.
    """
    if config.model.compile is False:
        return []
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
    ]
